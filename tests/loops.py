"""Independent float64 references, one sequence at a time (no padding, no masks)."""

import math

import torch

from gemctl.ops.bias import relative_position_bucket


def attention_loop(q, k, v, q_offsets, k_offsets, *, causal=False, scale=None, bias=None, window=None):
    """``window = w``: keys at aligned distance d = i + Lk - Lq - j with 0 <= d < w (causal) or
    |d| < w (not causal) only."""
    q, k, v = q.double(), k.double(), v.double()
    d = q.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = q * 0  # zeros that stay in the graph (empty rows get zero gradients)
    for b in range(q_offsets.numel() - 1):
        qs, qe = int(q_offsets[b]), int(q_offsets[b + 1])
        ks, ke = int(k_offsets[b]), int(k_offsets[b + 1])
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        s = torch.einsum("ihd,jhd->hij", q[qs:qe], k[ks:ke]) * scale  # (H, Lq, Lk)
        i = torch.arange(lq, device=q.device)[:, None]  # on q's device: the GPU tier's float64 references
        j = torch.arange(lk, device=q.device)[None, :]  # run there, not on one CPU thread per xdist worker
        dist = i + lk - lq - j
        if bias is not None:
            bucket = relative_position_bucket(dist, bias.table.shape[1], bias.max_distance)
            s = s + bias.table.double()[:, bucket]
        allowed = (dist >= 0) if causal else torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if window is not None:
            allowed = allowed & (dist < window) & ((dist >= 0) if causal else (dist > -window))
        has_key = allowed.any(-1)
        s = s.masked_fill(~allowed[None], float("-inf")).masked_fill(~has_key[None, :, None], 0.0)
        p = torch.softmax(s, dim=-1) * has_key[None, :, None]  # rows with no key -> zeros
        out[qs:qe] = torch.einsum("hij,jhd->ihd", p, v[ks:ke])
    return out


class _GeluPoly(torch.autograd.Function):
    """The Triton kernels' polynomial GELU with its fitted derivative, in float64: a reference that
    isolates the kernels' arithmetic from the approximation."""

    @staticmethod
    def forward(ctx, x):
        from gemctl.ops.triton.gdpa import gelu_poly_reference

        value, grad = gelu_poly_reference(x)
        ctx.save_for_backward(grad)
        return value

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0]


GDPA_ACTIVATIONS = {
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "silu": lambda x: x * torch.sigmoid(x),
    "gelu_poly": _GeluPoly.apply,
}


def gdpa_loop(q, k, v, q_offsets, k_offsets, *, activation="gelu", scale=None):
    q, k, v = q.double(), k.double(), v.double()
    d = q.shape[2]
    scale = d**-0.5 if scale is None else scale
    act = GDPA_ACTIVATIONS[activation]
    # one piece per sequence, concatenated (an in-place slice assignment per sequence made the
    # backward copy the whole output gradient once per sequence: minutes at a few hundred)
    pieces = []
    for b in range(q_offsets.numel() - 1):
        qs, qe = int(q_offsets[b]), int(q_offsets[b + 1])
        ks, ke = int(k_offsets[b]), int(k_offsets[b + 1])
        if ke == ks:
            pieces.append(q[qs:qe] * 0)  # zeros that stay in the graph (zero gradients)
            continue
        s = torch.einsum("ihd,jhd->hij", q[qs:qe], k[ks:ke]) * scale
        pieces.append(torch.einsum("hij,jhd->ihd", act(s), v[ks:ke]))
    return torch.cat(pieces) if pieces else q * 0


def block_loop(q, k, v, offsets, block_size, rope=None):
    q, k, v = q.double(), k.double(), v.double()
    d = q.shape[2]
    out = q * 0  # zeros that stay in the graph (empty rows get zero gradients)
    for b in range(offsets.numel() - 1):
        s0, e0 = int(offsets[b]), int(offsets[b + 1])
        qb, kb = q[s0:e0], k[s0:e0]
        if rope is not None:
            cos, sin = (t.double()[: e0 - s0, None, :] for t in rope)
            half = d // 2
            qb = torch.cat([qb[..., :half] * cos - qb[..., half:] * sin, qb[..., half:] * cos + qb[..., :half] * sin], -1)
            kb = torch.cat([kb[..., :half] * cos - kb[..., half:] * sin, kb[..., half:] * cos + kb[..., :half] * sin], -1)
        for start in range(0, e0 - s0, block_size):
            end = min(start + block_size, e0 - s0)
            s = torch.einsum("ihd,jhd->hij", qb[start:end], kb[start:end]) * d**-0.5
            out[s0 + start : s0 + end] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v[s0 + start : s0 + end])
    return out


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (max abs difference when b is all zero; 0 for empty tensors)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.numel() == 0:
        return 0.0
    norm = b.norm()
    return float((a - b).norm() / norm) if norm > 0 else float((a - b).abs().max())


def max_abs_err(a, b) -> float:
    """max |a - b| in float64 (0 for empty tensors): catches a few wrong elements a norm hides."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max()) if a.numel() else 0.0


def assert_errors(names, got, ref, baseline=None, *, tol=None, factor=None, floor=1e-3, elementwise=False):
    """Each got[i] is finite and within ``tol`` of ref[i] (relative error), or with ``factor``
    within factor * (error of baseline[i], the low-precision PyTorch path) + floor. With
    ``elementwise`` (and ``factor``) the largest element error is bounded the same way against
    the baseline's largest, plus floor * max |ref|: a few wrong elements hide in a norm."""
    assert factor is not None or not elementwise, "elementwise bounds need a baseline factor"
    baseline = baseline if baseline is not None else [None] * len(got)
    for name, g, r, b in zip(names, got, ref, baseline):
        assert torch.isfinite(g).all(), name
        err = rel_err(g, r)
        bound = tol if factor is None else factor * rel_err(b, r) + floor
        detail = "" if factor is None else f" (PyTorch path {rel_err(b, r):.2e})"
        assert err <= bound, f"{name}: rel err {err:.2e} > {bound:.2e}{detail}"
        if elementwise and factor is not None and r.numel():
            worst, base_worst = max_abs_err(g, r), max_abs_err(b, r)
            bound = factor * base_worst + floor * float(r.detach().abs().max())
            assert worst <= bound, f"{name}: max abs err {worst:.2e} > {bound:.2e} (PyTorch path {base_worst:.2e})"


def assert_compiles_same(f, inputs, backend="aot_eager", **tolerance):
    """torch.compile(f, fullgraph=True) traces (no graph break) and gives f's loss and gradients."""
    loss = torch.compile(f, fullgraph=True, backend=backend)(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    ref_loss = f(*inputs)
    ref_grads = torch.autograd.grad(ref_loss, inputs)
    assert torch.allclose(loss, ref_loss, **tolerance)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, **tolerance)


def offsets(lengths, device="cpu"):
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out.to(device)
