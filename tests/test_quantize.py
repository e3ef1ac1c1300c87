"""Int8 copies (spin_batch/models/quantize.py) and their C GEMM (spin_gemm_q8: int8 weights, inputs rounded
to int8 per group of 64): values against a float64 reference, batch independence, the torch fallback with
the same rounding, the whole-model copy on both CPU paths; the copy's LM head on C (RescoredHead: int4 proxy
logits, the best ids rescored by the int8 head)."""

from __future__ import annotations

import pytest
import torch

from spin_batch.models import cpu_decoder, execution
from spin_batch.models.checkpoint import load_state_dict
from spin_batch.models.llama import Linear
from spin_batch.models.loader import load_model
from spin_batch.models.quantize import (RESCORED, RescoredHead, fake_quantize_groups, quantize_groups4,
                                        quantize_rows)
from spin_batch.models.segments import Segments


def test_quantize_rows_rounds_each_row_to_its_own_scale():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 70, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    w[7] = 0.0  # an all-zero row keeps a finite scale and zero weights
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (40,) and torch.isfinite(scale).all()
    assert q.abs().max() <= 127 and (q.abs().amax(dim=1)[torch.arange(40) != 7] == 127).all()
    assert (q[7] == 0).all()
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()  # round to nearest: half a step at most


def groups_f64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, G, 64] the int8 values as float64, s [M, G, 1] the group scales): the rounding the
    int8 GEMM documents, written out here (float32 scale arithmetic, ties to even)."""
    M, K = x.shape
    xp = torch.nn.functional.pad(x, (0, -K % 64)).reshape(M, -(-K // 64), 64)
    amax = xp.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(xp * inv).double(), (amax / 127.0).double()


@pytest.mark.parametrize("M,O,K", [(1, 64, 64), (5, 960, 576), (13, 100, 70), (30, 33, 2), (0, 64, 8), (3, 70, 1536)])
def test_int8_gemm_matches_float64_reference(lib, M, O, K):
    g = torch.Generator().manual_seed(M * 1000 + O + K)
    w, x = torch.randn(O, K, generator=g), torch.randn(M, K, generator=g)
    if M:
        x[0, :64] = 0.0  # an all-zero group
        x[-1, ::17] *= 30.0  # a few large inputs
    q, scale = quantize_rows(w)
    y = cpu_decoder.PanelWeight(lib, q, scale)(x)
    assert y.shape == (M, O) and y.dtype == torch.float32
    xq, s = groups_f64(x)
    assert (xq.abs() <= 127).all()
    qp = torch.nn.functional.pad(q.double(), (0, -K % 64)).reshape(O, -(-K // 64), 64)
    per_group = torch.einsum("mgk,ogk->mgo", xq, qp) * s  # exact integer sums, then the group scales
    ref = per_group.sum(dim=1) * scale.double()
    bound = (per_group.shape[1] + 2) * 1.2e-7 * per_group.abs().sum(dim=1) * scale.double() + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    # the float32 inputs the rounding stands for: close to x, each within half a step of its group's scale
    if M:
        assert ((fake_quantize_groups(x) - x).abs() <= s.repeat_interleave(64, -1).reshape(M, -1)[:, :K] / 2 + 1e-6).all()


def test_int8_rows_result_does_not_depend_on_its_batch(lib):
    g = torch.Generator().manual_seed(7)
    q, scale = quantize_rows(torch.randn(3072, 576, generator=g))
    x = torch.randn(29, 576, generator=g)
    pw = cpu_decoder.PanelWeight(lib, q, scale)
    full = pw(x)
    for lo, hi in [(0, 1), (3, 4), (5, 10), (12, 25), (0, 29)]:
        assert torch.equal(pw(x[lo:hi]), full[lo:hi]), (lo, hi)


def test_an_int8_panel_needs_its_scale_and_only_it(lib):
    q, scale = quantize_rows(torch.randn(32, 16))
    with pytest.raises(ValueError, match="scale"):
        cpu_decoder.PanelWeight(lib, q)
    with pytest.raises(ValueError, match="scale"):
        cpu_decoder.PanelWeight(lib, torch.randn(32, 16), scale)


def test_quantized_linear_on_c_and_torch_paths_agree_with_its_int8_weights(lib):
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(50, 40, generator=g), torch.randn(50, generator=g), torch.randn(3, 40, generator=g)
    q, scale = quantize_rows(w)
    want = torch.nn.functional.linear(fake_quantize_groups(x), q.float() * scale[:, None], b)
    c_path, torch_path = Linear(w, b, quantize=True), Linear(w, b, panel=False, quantize=True)
    assert c_path.panel is not None and c_path.panel.dtype == torch.int8 and c_path.weight is None
    assert torch_path.panel is None and torch_path.weight.dtype == torch.int8
    for lin in (c_path, torch_path):
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    # a bfloat16 model's copy runs on the C int8 GEMM too (its rows widened), and gives rows in its dtype
    bf = Linear(w.bfloat16(), quantize=True)
    assert bf.panel is not None and bf.panel.dtype == torch.int8
    qb, sb = quantize_rows(w.bfloat16())
    want_bf = torch.nn.functional.linear(fake_quantize_groups(x.bfloat16().float()), qb.float() * sb[:, None])
    got_bf = bf(x.bfloat16())
    assert got_bf.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf.float(), want_bf.bfloat16().float(), rtol=1e-2, atol=1e-2)
    off_c = Linear(w.bfloat16(), panel=False, quantize=True)  # off the C path: int8 storage, torch rounding
    assert off_c.panel is None and off_c(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("path", ["c", "torch"])
def test_int8_copy_of_a_model_is_close_to_it_and_shares_its_embedding(tiny_dir, path):
    """The copy runs on the C kernels wherever the job lets the CPU use them (target.kernels torch: off),
    whichever path the target's float32 plan measured faster: int8 has no fast torch path."""
    target = load_model(tiny_dir, plan=execution.forced(path), execution=execution.Execution(cpu=path))
    on_planned_torch = load_model(tiny_dir, plan=execution.forced("torch")).int8_copy(load_state_dict(tiny_dir))
    assert on_planned_torch.c_decoder is not None
    copy = target.int8_copy(load_state_dict(tiny_dir))
    assert copy.embed is target.embed and len(copy.layers) == target.spec.num_layers
    assert (copy.c_decoder is not None) == (path == "c")
    assert isinstance(copy.lm_head, RescoredHead) == (path == "c")
    short = target.int8_copy(load_state_dict(tiny_dir), num_layers=1)
    assert len(short.layers) == 1
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, target.spec.vocab_size, (24,), generator=g)
    seg = Segments.build([(0, 24, 0)])
    want = target.forward(tokens, seg, target.allocate_cache(1, 64))
    got = copy.forward(tokens, seg, copy.allocate_cache(1, 64))
    assert not torch.equal(got, want)  # really quantized
    if path == "torch":
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    else:  # int4 logits but at each row's best ids (RescoredHead), where they are the int8 head's: its choices
        torch_copy = load_model(tiny_dir, plan=execution.forced("torch"), execution=execution.Execution(cpu="torch"))
        int8 = torch_copy.int8_copy(load_state_dict(tiny_dir)).forward(tokens, seg, torch_copy.allocate_cache(1, 64))
        assert torch.equal(got.argmax(-1), int8.argmax(-1))


def test_quantize_groups4_rounds_each_group_of_a_row_to_its_own_scale():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 150, generator=g)
    w[2, 64:128] = 0.0  # an all-zero group keeps a finite scale
    q, scale = quantize_groups4(w)
    assert q.shape == (6, 150) and scale.shape == (6, 3) and torch.isfinite(scale).all()
    assert q.abs().max() <= 7 and (q[2, 64:128] == 0).all()
    per = scale.repeat_interleave(64, dim=1)[:, :150]
    assert ((q.float() * per - w).abs() <= per / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("V,K", [(1000, 200), (5, 64)])
def test_rescored_head_is_int4_but_at_its_best_ids_where_it_is_the_int8_head(lib, V, K):
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(V, K, generator=g), torch.randn(9, K, generator=g) * 3
    head, int8 = RescoredHead(lib, w), Linear(w, quantize=True)
    assert int8.panel is not None
    got, want8 = head(x), int8(x)
    q4, s4 = quantize_groups4(w)
    proxy = fake_quantize_groups(x).double() @ (q4.double() * s4.double().repeat_interleave(64, dim=1)[:, :K]).T
    best = proxy.topk(min(RESCORED, V), dim=-1).indices
    rescored = torch.zeros(9, V, dtype=torch.bool).scatter_(1, best, True)
    assert torch.equal(got[rescored], want8[rescored])  # bit for bit the int8 GEMM's logits
    torch.testing.assert_close(got[~rescored].double(), proxy[~rescored], rtol=1e-5, atol=1e-4)
    assert torch.equal(got.argmax(-1), want8.argmax(-1))  # the int8 head's choice wherever the proxy ranks it
    for lo, hi in [(0, 1), (4, 5), (2, 9)]:
        assert torch.equal(head(x[lo:hi]), got[lo:hi])


def test_int8_copy_of_a_bfloat16_model_runs_in_one_c_call_and_agrees_with_its_torch_rounding(tiny_dir):
    """A bfloat16 target's int8 copy: the whole decoder in one C call over the bfloat16 cache (cpu_decoder.c
    widens the rows for the int8 GEMM), close to the target, and its choices those of the same copy on torch."""
    target = load_model(tiny_dir, dtype="bfloat16", plan=execution.forced("c"), execution=execution.Execution(cpu="c"))
    copy = target.int8_copy(load_state_dict(tiny_dir))
    assert copy.c_decoder is not None and copy.c_decoder.dtype == torch.bfloat16
    assert isinstance(copy.lm_head, RescoredHead)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, target.spec.vocab_size, (24,), generator=g)
    seg = Segments.build([(0, 24, 0)])
    cache = copy.allocate_cache(1, 64)
    assert cache.k.dtype == torch.bfloat16
    got = copy.forward(tokens, seg, cache)
    want = target.forward(tokens, seg, target.allocate_cache(1, 64))
    assert got.dtype == torch.float32 and torch.isfinite(got).all() and not torch.equal(got, want)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.5, agree  # a draft: close to the target, not equal


def test_an_int8_target_gets_every_logit_from_the_int8_head(tiny_dir):
    """int8_copy(draft=False), the copy target.quantize: int8 runs: its head is the int8 Linear on every id (a
    target's logits feed logprobs and sampling), where a draft's copy has the int4-scored RescoredHead."""
    target = load_model(tiny_dir)
    state = load_state_dict(tiny_dir)
    full, draft = target.int8_copy(state, draft=False), target.int8_copy(state)
    head = full.lm_head
    assert isinstance(head, Linear) and (head.panel is not None or head.scale is not None)
    x = torch.randn(5, target.spec.hidden_size)
    assert torch.equal(head(x), Linear(state["lm_head.weight" if "lm_head.weight" in state else
                                             "model.embed_tokens.weight"], quantize=True)(x))
    if target.plan.c_library:
        assert isinstance(draft.lm_head, RescoredHead)
