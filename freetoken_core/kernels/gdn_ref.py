"""Plain-torch references of `gdn.py`: the gated delta rule and the causal depthwise conv1d of
gated-delta-net (GDN) layers, reading and writing per-request state in slot pools.

A GDN layer keeps no KV pages: each request owns one slot of two pools, a conv state
[slots, C, K-1] (its last K-1 conv inputs) and a recurrent state [slots, Hv, dk, dv] (fp32 by
default; a bf16 pool is loaded to fp32, computed in fp32, stored rounded). Slot 0 is a dummy that
padded rows may read and write. These functions are the CPU path of the layer and the references
the Triton kernels are tested against, so they import nothing but torch.

The math is transformers' `qwen3_next` torch path (`torch_recurrent_gated_delta_rule`,
`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`/`_update`, `l2norm`). Per value head, with q/k
repeated from Hk to Hv heads (repeat_interleave), L2-normalised and q scaled by dk**-0.5:

    S = S * exp(g_t);  delta = (v_t - k_t^T S) * beta_t;  S = S + k_t delta^T;  o_t = q_t^T S

Decode and speculative verify (`*_update_ref`) take R rows per request (request-major, B*R rows).
Outputs of every row come from the slot's state; with `write_state` the slot ends holding the state
after the request's first `num_rows[i]` rows. Verify runs once with write_state=False over all k+1
rows, then replays the same inputs with num_rows = accepted count and write_state=True: no per-row
state copies (a Qwen3.6 state is ~61 MiB per request). The update references are vectorised over
requests and never sync with the host; the varlen (prefill) references loop over requests on the host.

The layer's glue has references here too, as the kernels fuse it: `gdn_gating_ref` (beta, g from
in_proj_ba's raw a, b) and `gated_rmsnorm_ref` (the per-head output norm); the recurrence references
take them as `gating=` / `out_norm=` like the kernels do. Two decode fusions have their unfused
sequences here as references: `gdn_decode_with_conv_ref` (the conv update, then the recurrence) and
`gdn_out_norm_gemv_ref` (the output norm, then out_proj).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .causal_conv1d_ref import conv1d_update_ref


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps), written as transformers (and fla) do: x * rsqrt(...)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool):
    """[..., Hk, dk] -> fp32 [..., Hv, dk]: repeat to the value heads, normalise, scale q."""
    rep = num_v_heads // q.shape[-2]
    q, k = q.float(), k.float()
    if rep != 1:  # value head h reads key head h // rep (transformers' repeat_interleave)
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k


def gdn_gating_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' gates from in_proj_ba's a, b [..., Hv]: (g fp32, beta in b's dtype), with
    g = -exp(A_log) * softplus(a + dt_bias) in fp32 and beta = sigmoid(b)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float()), b.sigmoid()


def gated_rmsnorm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3NextRMSNormGated over the last dim: `w * rmsnorm(x) * silu(z)`, normed in fp32
    and rounded (Llama style), times w in the model dtype, times silu(z) in fp32, rounded."""
    xf = x.float()
    h = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * F.silu(z.float())).to(x.dtype)


def _gates(g, beta, gating):
    """(g, beta) as given, or from raw (a, b) when gating = (A_log, dt_bias)."""
    return (g, beta) if gating is None else gdn_gating_ref(g, beta, *gating)


def _out(o: torch.Tensor, out_norm) -> torch.Tensor:
    return o if out_norm is None else gated_rmsnorm_ref(o, out_norm[1], out_norm[0], out_norm[2])


def _zero_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.zeros(v.shape[-2], k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)


def _delta_step(S: torch.Tensor, q_t, k_t, v_t, g_t, b_t):
    """One token for all heads at once: S [..., Hv, dk, dv] fp32; q_t, k_t [..., Hv, dk];
    v_t [..., Hv, dv]; g_t, b_t [..., Hv]. Returns (o_t [..., Hv, dv], new S)."""
    S = S * g_t.exp()[..., None, None]
    kv = (S * k_t[..., :, None]).sum(-2)
    delta = (v_t - kv) * b_t[..., None]
    S = S + k_t[..., :, None] * delta[..., None, :]
    return (S * q_t[..., :, None]).sum(-2), S


# ------------------------------------------------------------------------------- one sequence


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, one token at a time. q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv];
    state [Hv, dk, dv] (None: zeros; not modified). Returns (o [T, Hv, dv] in v's dtype,
    final state fp32)."""
    qf, kf = _prepare_qk(q, k, v.shape[-2], use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    S = _zero_state(k, v) if state is None else state.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[0]):
        out[t], S = _delta_step(S, qf[t], kf[t], vf[t], gf[t], bf[t])
    return out.to(v.dtype), S


def chunk_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `recurrent_gated_delta_rule_ref`, computed chunk by chunk (transformers'
    `torch_chunk_gated_delta_rule` for one sequence): inside a chunk the delta-rule updates are
    condensed into triangular solves (the WY / UT transform), so a prefill of T tokens costs
    T / chunk_size sequential steps of matmuls instead of T steps of outer products."""
    T, Hv, dv = v.shape
    qf, kf = _prepare_qk(q, k, Hv, use_qk_l2norm)
    # heads first: [Hv, T, d]; padded tokens (g = 0, beta = 0, k = v = 0) leave the state alone
    qf, kf, vf = (x.transpose(0, 1) for x in (qf, kf, v.float()))
    gf, bf = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    pad = (-T) % chunk_size
    qf, kf, vf = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, vf))
    gf, bf = F.pad(gf, (0, pad)), F.pad(bf, (0, pad))
    n = (T + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [Hv, n*c, d] -> [Hv, n, c, d]
        return x.reshape(Hv, n, chunk_size, x.shape[-1])

    v_beta, k_beta = chunked(vf * bf[..., None]), chunked(kf * bf[..., None])
    qf, kf = chunked(qf), chunked(kf)
    cum = gf.reshape(Hv, n, chunk_size).cumsum(-1)  # log of the decay from the chunk start to t
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).triu(1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (masked to -inf above the diagonal before exp)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ kf.transpose(-1, -2)) * decay
    attn = (qf @ kf.transpose(-1, -2)) * decay
    # Solve (I + strictly_lower(ut)) X = rhs (unitriangular: the solver ignores ut's diagonal and
    # upper part): u are the values each token writes given the chunk's earlier writes, w the
    # decayed keys through which the chunk reads the state it starts from.
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)

    S = _zero_state(k, v) if state is None else state.float().clone()
    q_dec = qf * cum.exp()[..., None]  # q reads the state decayed up to its own position
    k_dec = kf * (cum[..., -1:] - cum).exp()[..., None]  # k's write decays to the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, n, 1, 1]
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S
        out[:, i] = q_dec[:, i] @ S + attn[:, i] @ v_new
        S = S * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(Hv, n * chunk_size, dv)[:, :T].transpose(0, 1)
    return out.to(v.dtype).contiguous(), S


# ----------------------------------------------------------------------- prefill (varlen)


def gdn_varlen_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slot_ids: torch.Tensor,
    initial_zero: torch.Tensor | None = None, use_qk_l2norm: bool = True, chunk_size: int | None = 64,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Prefill of B sequences concatenated along T (request i owns rows cu_seqlens[i]:cu_seqlens[i+1]).
    Each starts from state_pool[slot_ids[i]] (zeros where initial_zero[i]: a first prefill chunk, so
    slots need no clearing) and its final state is written back there in place (a request of zero
    rows keeps its state, or gets zeros if initial_zero). chunk_size=None runs the token loop.
    gating / out_norm as in `gdn_recurrent_update_ref`. Returns o [T, Hv, dv] in v's dtype."""
    g, beta = _gates(g, beta, gating)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    slots = slot_ids.tolist()
    fresh = [False] * len(slots) if initial_zero is None else initial_zero.tolist()
    for i, slot in enumerate(slots):
        s, e = bounds[i], bounds[i + 1]
        state = None if fresh[i] else state_pool[slot]
        rows = (q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e])
        if chunk_size is None:
            o, S = recurrent_gated_delta_rule_ref(*rows, state=state, use_qk_l2norm=use_qk_l2norm)
        else:
            o, S = chunk_gated_delta_rule_ref(*rows, state=state, use_qk_l2norm=use_qk_l2norm,
                                              chunk_size=chunk_size)
        out[s:e] = o
        state_pool[slot] = S.to(state_pool.dtype)
    return _out(out, out_norm)


# --------------------------------------------------------------------- decode / verify


def gdn_recurrent_update_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slot_ids: torch.Tensor, num_rows: torch.Tensor, rows_per_req: int,
    write_state: bool = True, use_qk_l2norm: bool = True,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Decode / verify recurrence: q, k [B*R, Hk, dk]; v [B*R, Hv, dv]; g, beta [B*R, Hv], rows
    request-major. Row r of request i sees the state after rows 0..r-1 of that request. With
    write_state, slot i ends holding the state after its first num_rows[i] rows (0: unchanged);
    without it the pool is untouched. Returns o [B*R, Hv, dv] in v's dtype.
    gating = (A_log, dt_bias): g and beta are in_proj_ba's raw a and b (`gdn_gating_ref`).
    out_norm = (weight, z [B*R, Hv, dv], eps): returns `gated_rmsnorm_ref(o, z, weight, eps)`."""
    g, beta = _gates(g, beta, gating)
    R, B = rows_per_req, slot_ids.shape[0]
    Hv, dv = v.shape[-2:]
    qf, kf = _prepare_qk(q, k, Hv, use_qk_l2norm)
    qf, kf = qf.view(B, R, Hv, -1), kf.view(B, R, Hv, -1)
    vf, gf, bf = v.float().view(B, R, Hv, dv), g.float().view(B, R, Hv), beta.float().view(B, R, Hv)
    S = state_pool[slot_ids].float()  # [B, Hv, dk, dv]
    kept = S
    n = num_rows.to(torch.long).view(B, 1, 1, 1)
    out = torch.empty(B, R, Hv, dv, dtype=torch.float32, device=v.device)
    for r in range(R):
        out[:, r], S = _delta_step(S, qf[:, r], kf[:, r], vf[:, r], gf[:, r], bf[:, r])
        kept = torch.where(r < n, S, kept)  # the state after row r counts while r < num_rows
    if write_state:
        state_pool[slot_ids] = kept.to(state_pool.dtype)
    return _out(out.view(B * R, Hv, dv).to(v.dtype), out_norm)


def gdn_decode_with_conv_ref(
    x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, conv_state_pool: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, state_pool: torch.Tensor, slot_ids: torch.Tensor, num_rows: torch.Tensor,
    num_k_heads: int, use_qk_l2norm: bool = True,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Plain decode (one row per request, both states written) from the conv input x [B, C]: the SiLU conv
    update, its output split into [q (Hk dk) | k (Hk dk) | v (Hv dv)], then the recurrence."""
    B = slot_ids.shape[0]
    Hv, dk, dv = state_pool.shape[1:]
    key = num_k_heads * dk
    y = conv1d_update_ref(x, conv_weight, conv_bias, conv_state_pool, slot_ids, num_rows, 1, True)
    q, k, v = y[:, :key].view(B, num_k_heads, dk), y[:, key:2 * key].view(B, num_k_heads, dk), y[:, 2 * key:]
    return gdn_recurrent_update_ref(q, k, v.view(B, Hv, dv), g, beta, state_pool, slot_ids, num_rows, 1, True,
                                    use_qk_l2norm, gating, out_norm)


def gdn_out_norm_gemv_ref(o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's tail unfused: `gated_rmsnorm_ref` per head of o [T, H, dv] (or [T, H*dv]) with z [T, H, dv],
    stored in o's dtype, then out_proj (weight [N, H*dv]) accumulated in fp32 and rounded once, like
    the one-row GEMV (gemv_ref.gemv_reference). Returns [T, N] in o's dtype."""
    T, (H, dv) = o.shape[0], z.shape[-2:]
    h = gated_rmsnorm_ref(o.reshape(T, H, dv), z, norm_weight, eps).reshape(T, H * dv)
    y = h.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(o.dtype)
