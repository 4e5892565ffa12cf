import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashqla  # noqa: E402

HAS_SM90 = torch.cuda.is_available() and flashqla.kernels_available(torch.device("cuda"))

gpu = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU and the built flashqla extension")


def rel_l2(x, ref):
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()  # GPU results against CPU references
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def count_calls(monkeypatch, owner, name):
    """Wrap owner.name so that each call appends to the returned list (a test that a path was taken), then runs."""
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls
