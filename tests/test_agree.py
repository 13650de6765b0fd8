"""``comm.agree``: after one rank fails a unit of work, every rank learns it, or, when some rank never arrives
(blocked in a collective the failed rank left), the ones that did learn that instead of waiting for good."""

from __future__ import annotations

from distributed import run_distributed


def _rounds(fail_rank: int, absent_rank: int) -> list:
    import time

    import torch.distributed as dist

    from megasparse.parallel import comm, state

    state.init(1, 1, False, "gloo")
    r = dist.get_rank()
    out = [comm.agree(True, 5.0), comm.agree(r != fail_rank, 5.0)]
    if r == absent_rank:
        time.sleep(2.0)  # stands for a rank stuck in a collective: it never reaches the third round in time
        return out
    t0 = time.monotonic()
    out.append(comm.agree(True, 0.5))
    out.append(time.monotonic() - t0 < 1.5)
    return out


def test_agree_tells_every_rank_and_gives_up_on_an_absent_one():
    r0, r1 = run_distributed(_rounds, 2, 1, 1)
    assert r0 == [True, False, None, True]  # rank 1's failure seen; its absence noticed within the timeout
    assert r1 == [True, False]
