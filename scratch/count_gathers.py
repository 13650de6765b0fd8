"""Count row-gather ops (index_select / index / gather) in one collider train step, per source tensor."""

import sys
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, "tests")
from tiny import tiny  # noqa: E402

from megasparse.config import load_config  # noqa: E402
from megasparse.train import Trainer  # noqa: E402

OPS = ("index_select", "index.Tensor", "gather", "index_put", "index_add", "scatter_add", "cat", "copy_", "add", "mul")


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.c = Counter()
        self.src = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) + ("." + func._overloadname if func._overloadname != "default" else "")
        self.c[name] += 1
        if any(o in name for o in ("index_select", "index.Tensor", "gather")):
            a = args[0]
            self.src[(name, tuple(a.shape), a.data_ptr())] += 1
        return func(*args, **(kwargs or {}))


extra = sys.argv[1:]
cfg = load_config(None, tiny(model__num_layers=1, train__micro_batch_size=1, train__global_batch_size=1) + extra)
tr = Trainer(cfg)
tr.train_step()
m = Count()
with m:
    tr.train_step()
for k, v in sorted(m.c.items(), key=lambda x: -x[1])[:40]:
    print(f"{v:5d} {k}")
print("--- gather sources (count>1 means repeated gather of the same tensor)")
for k, v in m.src.items():
    print(v, k[0], k[1])
