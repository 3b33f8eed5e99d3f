"""Complex reduce-scatters of SUM and AVG run natively, as real views, like the allreduce.

c10d hands a complex allreduce to the backend as view_as_real views, but a reduce-scatter as
the complex tensors themselves; xdev views them the same way. Each form's result is checked
against a sum computed here and, bitwise, against the matching slice of xdev's own flat
allreduce of the same inputs; the last call's path is the native one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

import torch_xdev
from harness import run_ranks

DTYPES = (torch.complex64, torch.complex128)
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


def _input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 31 + rank)
    return torch.randn(numel, dtype=dtype, generator=g)


def _complex_reduce_scatters(rank: int, world: int) -> int:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    flat = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(algorithm="flat"))
    cases = 0
    for d, dtype in enumerate(DTYPES):
        for o, op in enumerate(OPS):
            for numel in (1, 7, 3001):
                seed = d * 1000 + o * 100 + numel
                inputs = [_input(seed, r, world * numel, dtype) for r in range(world)]
                total = torch.stack(inputs).sum(0)
                want = total / world if op == dist.ReduceOp.AVG else total
                mine = slice(rank * numel, (rank + 1) * numel)
                reduced = inputs[rank].clone()
                dist.all_reduce(reduced, op=op, group=flat)
                what = f"{dtype} {op} block={numel}"

                def check(got: torch.Tensor, form: str) -> None:
                    torch.testing.assert_close(got, want[mine], msg=f"{form} {what}")
                    assert torch.equal(got, reduced[mine]), f"{form} {what}: not the allreduce's"
                    path = torch_xdev.describe()["last_gather_scatter"][1]
                    assert path != "fallback", (form, what, torch_xdev.describe())

                got = torch.zeros(numel, dtype=dtype)
                dist.reduce_scatter_tensor(got, inputs[rank].clone(), op=op)
                check(got, "tensor")
                got = torch.zeros(numel, dtype=dtype)
                dist.reduce_scatter(got, list(inputs[rank].clone().chunk(world)), op=op)
                check(got, "list")
                got = torch.zeros(numel, dtype=dtype)
                other = torch.zeros(numel)  # a float pair beside it in one coalesced call
                with _coalescing_manager(async_ops=False):
                    dist.reduce_scatter_tensor(got, inputs[rank].clone(), op=op)
                    dist.reduce_scatter_tensor(other, torch.ones(world * numel), op=op)
                check(got, "coalesced")
                assert torch.equal(other, torch.full_like(other, 1.0 if op == OPS[1] else world))
                cases += 3
    dist.destroy_process_group()
    return cases


@pytest.mark.parametrize("world", [2, 3])
def test_complex_reduce_scatter_is_native_with_the_allreduces_bits(world: int) -> None:
    assert run_ranks(_complex_reduce_scatters, world, timeout=300)[0] == 36


def _mixed_dtypes_refused(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    messages = []
    # Only one side complex, or two complex dtypes: refused as before, naming the user's dtypes
    # (viewed as real, the first pair would have passed as float32 and been reinterpreted).
    for out, inp in (
        (torch.zeros(2, dtype=torch.complex64), torch.ones(4 * world)),
        (torch.zeros(4), torch.ones(2 * world, dtype=torch.complex64)),
        (torch.zeros(2, dtype=torch.complex64), torch.ones(2 * world, dtype=torch.complex128)),
    ):
        with pytest.raises(ValueError, match="dtypes differ") as info:
            dist.reduce_scatter_tensor(out, inp)
        messages.append(str(info.value))
    got = torch.zeros(3, dtype=torch.complex64)
    dist.reduce_scatter_tensor(got, torch.full((3 * world,), 1 + 2j, dtype=torch.complex64))
    assert torch.equal(got, torch.full((3,), world * (1 + 2j), dtype=torch.complex64))
    dist.destroy_process_group()
    return messages


def test_complex_and_real_mixed_are_refused_naming_the_dtypes() -> None:
    messages = run_ranks(_mixed_dtypes_refused, 2)[0]
    assert "ComplexFloat" in messages[0] and "ComplexDouble" in messages[2], messages


def _async_results(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    numel = 5
    inputs = [_input(7, r, world * numel, torch.complex64) for r in range(world)]
    want = torch.stack(inputs).sum(0)[rank * numel : (rank + 1) * numel]
    tensor_out = torch.zeros(numel, dtype=torch.complex64)
    list_out = torch.zeros(numel, dtype=torch.complex64)
    works = {
        "tensor": (
            dist.reduce_scatter_tensor(tensor_out, inputs[rank].clone(), async_op=True),
            tensor_out,
        ),
        "list": (
            dist.reduce_scatter(list_out, list(inputs[rank].clone().chunk(world)), async_op=True),
            list_out,
        ),
    }
    for form, (work, out) in works.items():
        future = work.get_future()
        work.wait()
        # The caller's complex tensor, not the real view the collective ran on.
        for shown in (work.result()[0], future.value()[0]):
            assert shown.dtype == torch.complex64 and shown.shape == (numel,), (form, shown)
            assert shown.data_ptr() == out.data_ptr(), form
        torch.testing.assert_close(out, want, msg=form)
    dist.destroy_process_group()


def test_async_complex_reduce_scatter_shows_the_complex_tensors() -> None:
    run_ranks(_async_results, 2)
