"""The rank program's lazy ``torch.compile``: Megatron imports without TorchInductor, and a deferred
function compiles with its own options at its first call and computes what the eager one does."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from pretrain.platform.lazy_compile import defer_torch_compile
defer_torch_compile()
import torch
import pretrain.train  # imports Megatron Core, whose fused kernels are decorated at import
after_import = {m: m in sys.modules for m in ("megatron.core", "torch._inductor.compile_fx")}
@torch.compile(backend="eager", dynamic=False)
def scaled(x):
    return x * 3 + 1
before_call = "torch._dynamo" in sys.modules
x = torch.arange(4.0)
first, second = scaled(x).tolist(), scaled(x).tolist()
print(json.dumps({"after_import": after_import, "dynamo_before_call": before_call,
                  "dynamo_after_call": "torch._dynamo" in sys.modules, "values": [first, second],
                  "name": scaled.__name__}))
"""


def test_megatron_imports_without_inductor_and_a_deferred_function_compiles_at_its_first_call() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after_import"] == {"megatron.core": True, "torch._inductor.compile_fx": False}
    assert (got["dynamo_before_call"], got["dynamo_after_call"]) == (False, True)  # compiled at the call
    assert got["values"] == [[1.0, 4.0, 7.0, 10.0]] * 2
    assert got["name"] == "scaled"
