"""Each Triton kernel against its reference under the Triton interpreter, float32 and float16."""
import pytest
import torch

import kcases

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter-internal numpy warning

DTYPES = [torch.float32, torch.float16]  # bfloat16: GPU only (the interpreter's bf16 dot is wrong)


def _params():
    for name, (_, cases) in kcases.CASES.items():
        for i, case in enumerate(cases):
            for dt in DTYPES:
                yield pytest.param(name, case, dt, id=f"{name}-{i}-{str(dt).split('.')[-1]}")


@pytest.mark.parametrize("name,case,dtype", list(_params()))
def test_triton_vs_ref(name, case, dtype):
    torch.manual_seed(hash((name, str(case), str(dtype))) % 2**31)
    kcases.CASES[name][0](dtype, "cpu", **case)
