"""A rigorous bound on an attention kernel's error against the reference run with the
kernel's own rounding schedule (``reference.attention.Schedule``).

What the schedule leaves open is the kernel's fp32 arithmetic: the order of its sums, its
exp2, its divisions, its running-max rescaling, and where its fp32 values sit relative to
the rounding points the schedule names. Per query row and head, with the scheduled K/V
(``K_j``, ``V_j``: exact float64 values of what the kernel multiplies), ``u = 2^-24``:

1. Logits ``s_j = sigma q.K_j``: ``|s_hat - s| <= e_j = (gamma_D + 3u) A_j`` with
   ``A_j = sigma sum_d |q_d K_jd|`` (the dot in any order; sigma and log2(e) rounded to fp32).
2. Probabilities relative to the chunk max ``m_c`` (the row's split, or the whole row):
   ``p_hat_j = p_j (1 + r_j)``, ``|r_j| <= rho_j = expm1(e_j + E_c + 2u(|x_j| + 2 S_c))
   + (T_c + 1)(eps_exp2 + 2u)`` where ``x_j = s_j - m_c``, ``E_c = max e`` (the kernel's
   max is off by at most that; a common factor cancels between numerator and sum, but it
   moves the points where P is rounded), ``S_c = max |s|`` (argument roundings, rescales
   by exp2 of max differences) and ``T_c`` the number of online-softmax rescales (at most
   one per 16 keys). Cross terms are covered by a 1.001 factor.
3. P as rounded by the schedule: the reference uses ``round(y_j) f_j`` (``y_j`` relative to
   the tile's running max or the chunk max, ``f_j`` the exact rescale to ``m_c``); the kernel
   rounds ``y_j (1 + r_j)``; rounding is monotone, so its value lies between
   ``round(y_j (1 - rho_j))`` and ``round(y_j (1 + rho_j))``: ``Delta_j`` is the larger
   distance from the reference's value, times ``f_j`` (``p_j rho_j`` when P is not rounded).
4. Chunk output ``o_c = N_c / l_c``: ``|N_hat - N| <= sum Delta_j |V_j| + gamma_{n+T}
   sum (P_j + Delta_j)|V_j|``, ``|l_hat - l| <= sum p_j rho_j + gamma_{n+T} sum p_j (1 +
   rho_j)``, and ``|o_hat - o| <= (|dN| + |o| |dl|) / (l - |dl|) (1 + eta) + eta |o|``, ``eta``
   the normalisation's relative error: ``eps_div + u`` for a division, or for a kernel that
   declares ``Fp32Arith(normalise="lse")`` (``acc * exp2(m - lse)``, a running log-sum-exp
   instead of a division) the bound of ``_normalisation_rel``.
5. Split-K: each partial rounded to the partial dtype deviates from the reference's rounded
   partial by the rounding interval of ``o_c +- b_c``; its LSE (``m_c + log l_c``, rounded
   to the LSE dtype) by the interval of ``lse_c +- (E_c + dl/(l - dl) + 2^-21 |lse_c|)``;
   the merge ``sum w_c o_c / sum w_c`` with ``w_c = exp(lse_c - max lse)`` then errs by at most
   ``max_c |do_c| + 2 max_c |o_c - out| expm1(2 max dlse + eps_exp2 + 2u) + gamma_{ns+2}
   max|o| + (eps_div + u) |out|`` (its products, two sums and final division).

With ``kv_dtype="float64"`` the kernel multiplies the exact decoded codes and applies the
(scalar) scales in fp32 outside the products: the logit scale ``sigma log2(e)`` times
k_scale is one more fp32 rounding (4u instead of 3u in 1.), and the output (each split's
partial) times v_scale one more (u added to the division's relative error in 4.).

The output's final rounding is left to the rounding-interval oracle (``oracle.core.intervals``),
which rounds ``e +- bound``.
"""

from __future__ import annotations

import numpy as np

from oracle.core.bounds import LOG2_ABS, Fp32Arith, U, gamma, tensor_core_rel
from reference.attention import decode_positions, prefill_positions, scheduled_q
from reference.codec import FORMATS, round_dtype
from reference.kv_cache import scale_at

RESCALE_KEYS = 16  # the smallest key tile an online-softmax kernel rescales after


def scheduled_kv(codes, fmt, scale, kv_dtype) -> np.ndarray:
    """The K or V values the schedule says a kernel multiplies (see ``Schedule.kv_dtype``)."""
    x = FORMATS[fmt].values[codes.astype(np.intp)]
    s = np.asarray(1.0 if scale is None else scale, np.float64)
    if kv_dtype == "float64":
        return x * s
    if kv_dtype not in ("float32", "float64"):
        x = round_dtype(x, kv_dtype)
    prod = round_dtype(x * round_dtype(s, "float32"), "float32")
    return prod if kv_dtype == "float32" else round_dtype(prod, kv_dtype)


def _rounding_deviation(y, rel, dtype):
    """Largest |round(y (1 +- rel)) - round(y)| (rounding to dtype; float64: rel |y|)."""
    if dtype == "float64":
        return np.abs(y) * rel
    r0 = round_dtype(y, dtype)
    lo = round_dtype(y * (1 - rel), dtype)
    hi = round_dtype(y * (1 + rel), dtype)
    return np.maximum(np.abs(lo - r0), np.abs(hi - r0))


def _interval_deviation(v, b, dtype):
    """Largest |round(v +- b) - round(v)|: how far a value within b of v may round."""
    if dtype == "float64":
        return b
    r0 = round_dtype(v, dtype)
    lo, hi = round_dtype(v - b, dtype), round_dtype(v + b, dtype)
    return np.maximum(np.abs(lo - r0), np.abs(hi - r0))


def _row_blocks(entries, last_block, order):
    """Valid selected blocks of one row, deduplicated, in schedule order."""
    seen, out = set(), []
    for b in entries.tolist():
        if 0 <= b <= last_block and b not in seen:
            seen.add(b)
            out.append(b)
    return sorted(out) if order == "ascending" else out


def _chunk_bound(s, a_mag, v, rank, sched, arith, d, dot_rel=0.0):
    """Bound ``[G, D]`` for one chunk of keys (s, a_mag ``[G, n]``; v ``[n, D]``; rank: the
    block rank of each key within the chunk, for tiles; dot_rel: the declared tensor-core
    error of a dot of at most 256 terms). Returns (o, bound, lse, dlse)."""
    n = s.shape[1]
    outside = sched.kv_dtype == "float64"  # the scales applied in fp32 after the products
    e = (gamma(d) + (4 if outside else 3) * U + tensor_core_rel(dot_rel, d)) * a_mag
    m = s.max(axis=1, keepdims=True)
    x = s - m
    big_e = e.max(axis=1, keepdims=True)
    big_s = np.abs(s).max(axis=1, keepdims=True)
    # Rescalings of a key's P and sum: one per tile at most, one more at the end, and one
    # per other key stream when streams merge (Schedule.key_streams).
    tiles = -(-n // RESCALE_KEYS) + sched.key_streams - 1
    rho = (np.expm1(e + big_e + 2 * U * (np.abs(x) + 2 * big_s))
           + (tiles + 1) * (arith.exp2_rel + 2 * U)) * 1.001
    p = np.exp(x)
    if sched.p_max == "running" and sched.p_dtype != "float64":
        tile = rank // sched.blocks_per_tile
        ref = np.empty_like(s)
        run = np.full((sched.key_streams, s.shape[0]), -np.inf)  # per key stream
        for t in range(int(tile.max()) + 1):
            cols = tile == t
            if cols.any():
                w = t % sched.key_streams  # tile_keys x key_streams = P: a tile's stream
                run[w] = np.maximum(run[w], s[:, cols].max(axis=1))
                ref[:, cols] = run[w][:, None]
    else:
        ref = np.broadcast_to(m, s.shape)
    y, f = np.exp(s - ref), np.exp(ref - m)
    p_sched = round_dtype(y, sched.p_dtype) * f
    delta = _rounding_deviation(y, rho, sched.p_dtype) * f
    g = gamma(n + tiles + 1)
    if dot_rel:  # P @ V on tensor cores: one MMA sum per tile of keys
        tile_keys = int(np.bincount(rank // sched.blocks_per_tile).max()) \
            if sched.p_max == "running" else n
        g += tensor_core_rel(dot_rel, tile_keys)
    av = np.abs(v)
    dn = delta @ av + g * ((p_sched + delta) @ av)
    l_sum = p.sum(axis=1, keepdims=True)
    dl = (p * rho).sum(axis=1, keepdims=True) + g * (p * (1 + rho)).sum(axis=1, keepdims=True)
    o = (p_sched @ v) / l_sum
    div = _normalisation_rel(arith, m + big_e, l_sum + dl, 2 if outside else 1)
    bound = (dn + np.abs(o) * dl) / (l_sum - dl) * (1 + div) + div * np.abs(o)
    lse = m + np.log(l_sum)
    dlse = big_e + dl / (l_sum - dl) + 2.0**-21 * np.abs(lse)
    return o, bound, lse[:, 0], dlse[:, 0]


def _normalisation_rel(arith, m_mag, l_top, roundings: int):
    """Relative error ``eta`` of the chunk's normalisation, ``o_hat = (N_hat / l_hat)(1 +
    eta)``, given ``|m| <= m_mag`` (the chunk max, natural units) and ``l_hat <= l_top``;
    ``roundings``: fp32 roundings of the final product(s) (the v_scale outside adds one).

    ``arith.normalise == "divide"``: ``N_hat / l_hat`` rounded: ``eps_div + roundings u``.
    ``"lse"``: ``N_hat exp2(m2 - lse2)`` with base-2 logits ``m2 = m log2(e)``, ``L =
    log2(l_hat)`` computed within ``eps_log2 |L| + LOG2_ABS``, ``lse2 = fl(m2 + L)`` (error
    ``u |m2 + L|``) and the argument ``fl(m2 - lse2)`` (error ``u |L|``, to first order):
    the argument is ``-L + delta``, ``|delta| <= (eps_log2 + 3u)|L| + u |m2| + LOG2_ABS``
    (times 1.001 for the second-order terms), so ``exp2`` of it is ``(1 / l_hat) 2^delta
    (1 + eps_exp2)`` and the product's roundings add ``roundings u``: ``|eta| <=
    expm1(delta ln 2 + eps_exp2 + roundings u)``. With ``1 <= l_hat <= l_top``,
    ``|L| <= log2(l_top)``. Sound wherever the kernel's ``m2`` is its own logits' max (the
    same max its probabilities are relative to), as an online softmax keeps it."""
    if arith.normalise == "divide":
        return arith.div_rel + roundings * U
    big_l = np.log2(np.maximum(l_top, 1.0))
    delta = ((arith.log2_rel + 3 * U) * big_l + U * np.abs(m_mag) * np.log2(np.e)
             + LOG2_ABS) * 1.001
    return np.expm1(delta * np.log(2.0) + arith.exp2_rel + roundings * U)


def _row_bound(q, keys_k, keys_v, key_chunk, key_rank, sched, arith, softmax_scale,
               dot_rel=0.0):
    """Bound ``[G, D]`` of one row for one KV head."""
    d = q.shape[-1]
    s = softmax_scale * (q @ keys_k.T)
    a_mag = softmax_scale * (np.abs(q) @ np.abs(keys_k).T)
    chunks = np.unique(key_chunk)
    parts = [_chunk_bound(s[:, key_chunk == c], a_mag[:, key_chunk == c],
                          keys_v[key_chunk == c], key_rank[key_chunk == c], sched, arith, d,
                          dot_rel)
             for c in chunks]
    if sched.blocks_per_split is None:
        return parts[0][1]
    o = np.stack([p[0] for p in parts])  # [ns, G, D]
    b = np.stack([p[1] for p in parts])
    lse = np.stack([p[2] for p in parts])  # [ns, G]
    dlse = np.stack([p[3] for p in parts])
    do = _interval_deviation(o, b, sched.partial_dtype)
    lse_dev = _interval_deviation(lse, dlse, sched.lse_dtype)
    o_r = round_dtype(o, sched.partial_dtype)
    lse_r = round_dtype(lse, sched.lse_dtype)
    w = np.exp(lse_r - lse_r.max(axis=0))
    out = (w[..., None] * o_r).sum(axis=0) / w.sum(axis=0)[..., None]
    omega = np.expm1(2 * lse_dev.max(axis=0) * 2 + arith.exp2_rel + 2 * U)[..., None]
    spread = np.abs(o_r - out).max(axis=0)
    merge = gamma(len(chunks) + 2) * np.abs(o_r).max(axis=0)  # w * o, the two sums
    division = (arith.div_rel + U) * np.abs(out)
    return (do.max(axis=0) + 2 * spread * omega + merge + division) * 1.001


def attention_bound(x: dict, sched, arith: Fp32Arith, softmax_scale=None,
                    dot_rel: float = 0.0) -> np.ndarray:
    """Bound ``[T, Hq, D]`` on |kernel pre-rounding output - reference(schedule) unrounded|
    for a case's inputs (prefill or decode). ``dot_rel``: the implementation's declared
    error of its dot products beyond IEEE fp32 sums (``score_rel``: tensor cores), added to
    the logits' ``e_j`` (relative to ``A_j``) and to the ``P @ V`` sums (relative to
    ``sum P |V|``, per tile of keys)."""
    q = x["q"]
    t_rows, _, d = q.shape
    sigma = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    seq = np.asarray(x["seq_lens"], np.int64)
    if "rows_per_request" in x:
        req, pos = decode_positions(seq, x["rows_per_request"])
    else:
        req, pos = prefill_positions(x["cu_seqlens_q"], seq, t_rows)
    topk = np.asarray(x["topk"])
    bound = np.zeros(q.shape)
    q_sched = scheduled_q(q, sched.q_dtype)
    hkv = x["kv_cache"].shape[1]
    grp = q.shape[1] // hkv
    rows = np.flatnonzero(pos >= 0)
    with np.errstate(invalid="ignore", over="ignore"):  # Inf/NaN propagate as exact values
        for g in range(hkv):
            kv = _head_kv(x, g, sched) if rows.size else None
            heads = slice(g * grp, (g + 1) * grp)
            for t in rows:
                keys = _row_keys(x, int(req[t]), int(pos[t]), g, topk[g, t], seq, sched, kv)
                if keys is not None:
                    bound[t, heads] = _row_bound(q_sched[t, heads], *keys, sched, arith, sigma,
                                                 dot_rel)
    return bound


def _head_kv(x, g, sched):
    """Scheduled K and V ``[num_pages, P, D]`` of every slot of KV head g (``scheduled_kv``
    once per head, not once per row)."""
    cache, fmt = x["kv_cache"], x["kv_fmt"]
    pages, _, page, d2 = cache.shape
    codes = cache[:, g]
    slots = np.arange(pages * page).reshape(pages, page)

    def scale(name):
        if x[name] is None:
            return None
        sc = np.asarray(scale_at(x[name], g, slots.ravel()), np.float64)
        return sc if sc.size == 1 else sc.reshape(pages, page, 1)

    return (scheduled_kv(codes[..., :d2 // 2], fmt, scale("k_scale"), sched.kv_dtype),
            scheduled_kv(codes[..., d2 // 2:], fmt, scale("v_scale"), sched.kv_dtype))


def _row_keys(x, r, p, g, entries, seq, sched, kv=None):
    """Scheduled K, V ``[n, D]`` of the keys row (r, p) sees through KV head g, each key's
    split chunk and block rank within it (the rank of its tile of ``Schedule.tile_keys``
    keys, when set); None when it sees no key. ``kv``: head g's
    ``_head_kv`` when already computed."""
    cache, fmt = x["kv_cache"], x["kv_fmt"]
    page, d = cache.shape[2], cache.shape[3] // 2
    blocks = _row_blocks(entries, p // page, sched.order)
    bps = sched.blocks_per_split or max(1, len(blocks))
    spans = [np.arange(b * page, min((b + 1) * page, p + 1, int(seq[r]))) for b in blocks]
    if not spans or not sum(js.size for js in spans):
        return None
    js = np.concatenate(spans)
    chunk = np.concatenate([np.full(sp.size, i // bps) for i, sp in enumerate(spans)])
    rank = np.concatenate([np.full(sp.size, i % bps) for i, sp in enumerate(spans)])
    if sched.tile_keys is not None:  # the tile's rank (Schedule.tile_keys)
        sub = page // sched.tile_keys
        rank = rank * sub + (js % page) // sched.tile_keys
    pages = x["block_table"][r, js // page].astype(np.int64)
    if kv is not None:
        return kv[0][pages, js % page], kv[1][pages, js % page], chunk, rank
    slots = pages * page + js % page
    codes = cache[pages, g, js % page]

    def scale(name):
        return None if x[name] is None else np.reshape(scale_at(x[name], g, slots), (-1, 1))

    k = scheduled_kv(codes[:, :d], fmt, scale("k_scale"), sched.kv_dtype)
    v = scheduled_kv(codes[:, d:], fmt, scale("v_scale"), sched.kv_dtype)
    return k, v, chunk, rank
