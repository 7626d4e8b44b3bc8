"""tests/gpu/mutate_kernels.py (the GPU kernels' mutation check) stays runnable: every substitution of its table
matches its kernel source exactly once, and the mutated Python files compile."""

import importlib.util
import sys

from conftest import REPO


def test_every_kernel_mutant_applies_exactly_once():
    spec = importlib.util.spec_from_file_location("mutate_kernels", REPO / "tests" / "gpu" / "mutate_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    assert len(module.MUTANTS) >= 30
    assert module.check_table() == []
    # the check itself notices a substitution that no longer matches
    stale = module.Mutant("stale", "deepseek_v41/kernels_triton.py", "no such text", "", (), "")
    assert module.check_table([stale]) == [
        "stale: deepseek_v41/kernels_triton.py holds 0 copies of 'no such text' (needs exactly 1)"]
