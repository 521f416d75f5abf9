"""Independent oracles, written from the formulas in docs/rollout-correction.md in plain Python floats
(IEEE double): no torch, nothing imported from the plugin or from unirl's losses.

Everything is per sample: lists of floats aligned with the response, ``mask`` 0/1.
"""

from __future__ import annotations

import math

CLAMP = 20.0


def _clamp(x: float, lo: float = -CLAMP, hi: float = CLAMP) -> float:
    return max(lo, min(hi, x))


def weights(old, roll, mask, *, mode: str, threshold: float = 2.0, lower: float | None = None):
    """Per sample, per token: the correction weight (None on inactive tokens)."""
    lower = 1.0 / threshold if lower is None else lower
    out = []
    for o, r, m in zip(old, roll, mask, strict=True):
        d = [oi - ri for oi, ri, mi in zip(o, r, m, strict=True) if mi]
        n = len(d)
        if mode == "none":
            ws = [1.0] * n
        elif mode == "token_tis":
            ws = [min(math.exp(_clamp(x)), threshold) for x in d]
        elif mode == "token_mask":
            ws = [1.0 if lower <= math.exp(_clamp(x)) <= threshold else 0.0 for x in d]
        else:
            total = sum(d)
            if mode == "geo_mask":
                total = total / n if n else 0.0
            ratio = math.exp(_clamp(total))
            if mode == "seq_tis":
                w = min(ratio, threshold)
            else:  # seq_mask, geo_mask
                w = 1.0 if lower <= ratio <= threshold else 0.0
            ws = [w] * n
        it = iter(ws)
        out.append([next(it) if mi else None for mi in m])
    return out


def diagnostics(old, roll, mask, w, *, mode: str, threshold: float = 2.0, lower: float | None = None):
    """The global diagnostics of one step batch."""
    lower = 1.0 / threshold if lower is None else lower
    toks, seq_hit, live = [], 0, 0
    for o, r, m, ws in zip(old, roll, mask, w, strict=True):
        d = [oi - ri for oi, ri, mi in zip(o, r, m, strict=True) if mi]
        active_w = [x for x, mi in zip(ws, m, strict=True) if mi]
        if not d:
            continue
        live += 1
        if mode == "token_tis":
            hits = [math.exp(_clamp(x)) > threshold for x in d]
        elif mode == "seq_tis":
            hits = [math.exp(_clamp(sum(d))) > threshold] * len(d)
        elif mode == "none":
            hits = [False] * len(d)
        else:
            hits = [x == 0.0 for x in active_w]
        seq_hit += any(hits)
        toks += [(oi - ri, oi, ri, x, h) for (oi, ri), x, h in
                 zip([(a, b) for a, b, mi in zip(o, r, m, strict=True) if mi], active_w, hits, strict=True)]
    n = len(toks)
    if n == 0:
        return None
    sw = sum(t[3] for t in toks)
    sw2 = sum(t[3] ** 2 for t in toks)
    return {
        "rc/active_tokens": n,
        "rc/active_seqs": live,
        "rc/weight_mean": sw / n,
        "rc/weight_max": max(t[3] for t in toks),
        "rc/weight_min": min(t[3] for t in toks),
        "rc/clipped_token_frac": sum(t[4] for t in toks) / n,
        "rc/clipped_seq_frac": seq_hit / live,
        "rc/ess_frac_global": sw * sw / (n * sw2) if sw2 else 0.0,
        "rc/logp_diff_abs_mean": sum(abs(t[0]) for t in toks) / n,
        "rc/logp_diff_abs_max": max(abs(t[0]) for t in toks),
        "rc/kl_k3": sum(math.exp(_clamp(t[0])) - 1 - _clamp(t[0]) for t in toks) / n,
        "rc/ppl_ratio": math.exp(-sum(t[2] for t in toks) / n) / math.exp(-sum(t[1] for t in toks) / n),
    }


def ppo_loss_and_grad(logp, old, adv, mask, w, *, clip_low: float, clip_high: float, agg: str,
                      norm_len: float):
    """The weighted PPO-clip loss of the whole batch and its gradient d loss / d logp_t (0 on inactive).

    l_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) * w_t,  r = exp(logp - old)
    """
    lens = [sum(1 for x in m if x) for m in mask]
    total_tokens = sum(lens) or 1
    total_seqs = sum(1 for n in lens if n) or 1
    loss, grad = 0.0, []
    for lp, o, a, m, ws, n in zip(logp, old, adv, mask, w, lens, strict=True):
        if agg == "token-mean":
            scale = 1.0 / total_tokens
        elif agg == "seq-mean-token-mean":
            scale = 1.0 / max(n, 1) / total_seqs
        elif agg == "seq-mean-token-sum":
            scale = 1.0 / total_seqs
        elif agg == "seq-mean-token-sum-norm":
            scale = 1.0 / norm_len / total_seqs
        else:
            raise ValueError(agg)
        g = []
        for lpi, oi, ai, mi, wi in zip(lp, o, a, m, ws, strict=True):
            if not mi:
                g.append(0.0)
                continue
            r = math.exp(_clamp(lpi - oi))
            unclipped = -ai * r
            clipped = -ai * min(max(r, 1 - clip_low), 1 + clip_high)
            loss += max(unclipped, clipped) * wi * scale
            g.append(0.0 if clipped > unclipped else -ai * r * wi * scale)
        grad.append(g)
    return loss, grad
