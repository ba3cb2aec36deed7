"""The host side of sampling: each batch row's settings (`RowSampling`) padded into the
`SamplingMetadata` arrays the device sampler (`jaxinfer.ops.sampler`) reads, grammar masks included."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from jaxinfer.engine.structured import fill_bitmasks
from jaxinfer.ops.sampler import NUM_BANNED, SamplingMetadata
from jaxinfer.sampling_params import MAX_LOGIT_BIAS


def build_metadata(
    rows: list,
    batch_size: int,
    *,
    num_slots: int,
    max_logprobs: int,
    neutral_bias=None,
    vocab_size: Optional[int] = None,
    neutral_mask=None,
    prior_width: int = 0,
) -> SamplingMetadata:
    """Pad per-row host values into a `SamplingMetadata` of ``batch_size`` rows.

    ``rows`` holds one `RowSampling` (or None for a padding row) per batch row;
    ``max_logprobs`` is the engine's (the width of every step's top-logprobs output).
    ``neutral_bias(batch_size)``, when given, supplies the (bias_ids, bias_values) of a
    batch in which no row has a logit_bias (the runner keeps them on device, so such a
    step ships no [B, MAX_LOGIT_BIAS] arrays); otherwise they are built here.
    ``vocab_size`` (the logits' width) adds the allowed-token bitmask: rows whose `RowSampling`
    carries a constraint get their grammar's next-token mask (`jaxinfer.engine.structured.fill_bitmasks`),
    others all ones; ``neutral_mask(batch_size)`` likewise supplies an all-ones one kept on device.
    ``prior_width`` > 0 (an engine that speculates ``prior_width`` tokens) adds each row's `RowSampling.prior`,
    the drafts before it in its verify segment, padded with -1.
    """
    f32 = lambda: np.zeros(batch_size, np.float32)  # noqa: E731
    temp, top_p, min_p = f32(), np.ones(batch_size, np.float32), f32()
    pres, freq, rep = f32(), f32(), np.ones(batch_size, np.float32)
    top_k = np.zeros(batch_size, np.int32)
    seeds = np.zeros(batch_size, np.uint32)
    pos = np.zeros(batch_size, np.int32)
    banned = np.full((batch_size, NUM_BANNED), -1, np.int32)
    slots = np.full(batch_size, num_slots, np.int32)
    is_out = np.zeros(batch_size, np.bool_)
    plens = np.zeros(batch_size, np.int32)
    want_lp = np.zeros(batch_size, np.bool_)
    want_plp = np.zeros(batch_size, np.bool_)
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r is not None and r.params.logit_bias]
    if biased or neutral_bias is None:
        bias_ids = np.full((batch_size, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((batch_size, MAX_LOGIT_BIAS), np.float32)
        for i, bias in biased:
            bias_ids[i, : len(bias)] = list(bias.keys())
            bias_values[i, : len(bias)] = list(bias.values())
    else:
        bias_ids, bias_values = neutral_bias(batch_size)
    allowed = None
    if vocab_size is not None:
        constrained = [(r.constraint, i) for i, r in enumerate(rows) if r is not None and r.constraint is not None]
        given = [(i, r.mask) for i, r in enumerate(rows) if r is not None and r.mask is not None]
        if constrained or given or neutral_mask is None:
            allowed = fill_bitmasks(constrained, batch_size, vocab_size)
            for i, mask in given:
                allowed[i] = mask
        else:
            allowed = neutral_mask(batch_size)
    prior = np.full((batch_size, prior_width), -1, np.int32) if prior_width else None
    for i, r in enumerate(rows):
        if r is None:
            continue
        if r.prior:
            prior[i, : len(r.prior)] = r.prior
        sp = r.params
        temp[i], top_p[i], min_p[i], top_k[i] = sp.temperature, sp.top_p, sp.min_p, sp.top_k
        pres[i], freq[i], rep[i] = sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
        seeds[i], pos[i], slots[i], is_out[i] = r.seed, r.sample_pos, r.slot, r.is_output
        plens[i] = r.prompt_len if r.prompt_len is not None else r.sample_pos
        if r.banned:
            ids = list(r.banned)[:NUM_BANNED]
            banned[i, : len(ids)] = ids
        want_lp[i] = sp.logprobs is not None
        want_plp[i] = sp.prompt_logprobs is not None
    return SamplingMetadata(
        temperature=temp,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=pres,
        frequency_penalty=freq,
        repetition_penalty=rep,
        seeds=seeds,
        sample_pos=pos,
        banned=banned,
        slot_ids=slots,
        is_output=is_out,
        prompt_lens=plens,
        want_logprobs=want_lp,
        want_prompt_logprobs=want_plp,
        bias_ids=bias_ids,
        bias_values=bias_values,
        allowed=allowed,
        prior=prior,
        max_logprobs=int(max_logprobs),
    )


@dataclasses.dataclass
class RowSampling:
    """Host-side sampling inputs of one batch row."""

    params: object  # SamplingParams
    seed: int
    sample_pos: int
    slot: int
    is_output: bool = True
    banned: tuple = ()
    prompt_len: Optional[int] = None  # None: everything before sample_pos is prompt
    constraint: object = None  # `jaxinfer.engine.structured.Constraint` of a row that draws a constrained output token
    prior: tuple = ()  # speculative decoding: the drafts before this row in its verify segment (outputs for penalties)
    mask: Optional[np.ndarray] = None  # an allowed-token bitmask computed already (a constrained verify row)
