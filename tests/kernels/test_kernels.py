"""Each Triton kernel against its reference under the Triton interpreter, float32 and float16."""
import pytest
import torch

import harness.kernel_cases as kcases

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter-internal numpy warning

DTYPES = [torch.float32, torch.float16]  # bfloat16: GPU only (the interpreter's bf16 dot is wrong)


def _params():
    seed = 0  # a fixed integer per case, so a failure reproduces with its id alone
    for name, (_, cases) in kcases.CASES.items():
        for i, case in enumerate(cases):
            for dt in DTYPES:
                seed += 1
                yield pytest.param(name, case, dt, seed, id=f"{name}-{i}-{str(dt).split('.')[-1]}-seed{seed}")


@pytest.mark.parametrize("name,case,dtype,seed", list(_params()))
def test_triton_vs_ref(name, case, dtype, seed):
    torch.manual_seed(seed)
    kcases.CASES[name][0](dtype, "cpu", **case)
