"""Session 33: reproduce session 32's segfault (the raw forward op given a malformed seq_order), step by step."""
import sys, faulthandler
faulthandler.enable()
sys.path.insert(0, "tests")
import torch
import flashqla
from test_gpu_fwd import make, D, captured
mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
d = make([300, 8000, 0, 100], 2, 8, seed=51)
op = torch.ops.flashqla.chunk_gdn_fwd
args = (d["q"], d["k"], d["v"], d["g"], d["beta"], D ** -0.5, d["initial_state"], True, d["cu_seqlens"], False)
plain = op(*args); torch.cuda.synchronize(); print("plain ok", flush=True)
if mode == "full":
    for order, workers in (([3, 2, 1, 0], 3), ([1, 0, 3, 2], 1000), ([0, 1, 2, 3], 0), ([2, 3, 1, 0], 5)):
        o, s = op(*args, torch.tensor(order, dtype=torch.int32, device="cuda"), workers)
        torch.cuda.synchronize(); print("order", order, workers, torch.equal(o, plain[0]), flush=True)
order = torch.tensor([1, 0, 3, 2], dtype=torch.int32, device="cuda")
for name, bad in (("long", (order.long(), 10)), ("short", (order[:3], 10)), ("workers", (order, -1)),
                  ("cpu", (order.cpu(), 10))):
    print("calling", name, flush=True)
    try:
        op(*args, *bad)
        print(name, "NO ERROR", flush=True)
    except RuntimeError as e:
        print(name, "raised:", str(e).splitlines()[0][:160], flush=True)
print("done", flush=True)
