"""Build tiny random-weight reference models for the model families jaxinfer
supports and record what Hugging Face transformers computes with them.

The jaxinfer tests load these directories (config, safetensors, tokenizer,
GGUF) with the engine's own code and compare against ``reference.npz``, so the
tests never need torch or transformers.

Regenerate
----------
Reference environment (never install it into the project's own venv)::

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 transformers==5.23.0 accelerate \\
        gguf safetensors tokenizers jinja2
    /work/refvenv/bin/python scripts/make_family_fixtures.py

It writes ``tests/fixtures/families/<family>/`` for every family below and
checks everything it writes (see "Checks"). It is deterministic: every random
draw is seeded, torch runs on CPU with ``torch.set_num_threads(2)``; the
versions used are recorded in every ``reference.json``. ``--only FAMILY``
rebuilds one family.

Families
--------
All models: hidden 64, 4 query heads, 2 KV heads, head_dim 16, intermediate
64, vocab_size 320, max_position_embeddings 256, 2 layers, float32, unless
listed otherwise:

* ``llama3``  LlamaForCausalLM. rope llama3 scaling (factor 8,
  low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 32),
  rope_theta 1e4, rms_norm_eps 1e-5, tied embeddings.
* ``qwen2``   Qwen2ForCausalLM (q/k/v biases). rope_theta 1e6, yarn scaling
  (factor 4, original_max_position_embeddings 64), untied.
* ``qwen3``   Qwen3ForCausalLM. head_dim 32 (heads*head_dim = 128 != hidden
  64), q_norm/k_norm, rope_theta 1e6, tied.
* ``gemma3``  Gemma3ForCausalLM (model_type gemma3_text). 6 layers with
  layer_types = 5 x sliding_attention + full_attention, sliding_window 8,
  query_pre_attn_scalar 24, hidden_activation gelu_pytorch_tanh,
  rope_parameters {full_attention: linear factor 8, theta 1e6;
  sliding_attention: default, theta 1e4}, final/attn logit softcapping null,
  tied (Gemma always is).
* ``mistral`` MistralForCausalLM. sliding_window 12, rope_theta 1e4,
  rms_norm_eps 1e-5, untied.
* ``qwen3_moe`` Qwen3MoeForCausalLM. 3 layers, 8 experts, top-2,
  moe_intermediate_size 16, norm_topk_prob true, decoder_sparse_step 1,
  mlp_only_layers [] (experts in every layer, as in the released Qwen3-MoE
  models and as llama.cpp's qwen3moe requires), rope_theta 1e6, untied.
* ``mixtral`` MixtralForCausalLM. 8 local experts, top-2, per-expert
  intermediate_size 16, sliding_window null, rope_theta 1e6,
  rms_norm_eps 1e-5, untied.
* ``deepseek_v3`` DeepseekV3ForCausalLM (multi-head latent attention).
  3 layers, num_key_value_heads 4 (= heads, as DeepSeek configs have it:
  kv_b_proj already makes one key/value per head), q_lora_rank 24,
  kv_lora_rank 32, qk_nope_head_dim 16, qk_rope_head_dim 8, v_head_dim 16,
  intermediate_size 32 (the dense first layer: first_k_dense_replace 1),
  8 routed experts (moe_intermediate_size 8), top-2, n_shared_experts 1,
  n_group 4 / topk_group 2 (noaux_tc: sigmoid scores + e_score_correction_
  bias), norm_topk_prob true, routed_scaling_factor 2.5, rope_interleave
  true, rope_parameters yarn (theta 1e4, factor 4,
  original_max_position_embeddings 64, beta_fast 32, beta_slow 1, mscale 1,
  mscale_all_dim 1), rms_norm_eps 1e-6, untied; config.json also carries
  scoring_func "sigmoid" and topk_method "noaux_tc" (hub V3 configs have
  them; transformers 5 keeps them as extra attributes, its V3 router ignores
  them) and the class default num_nextn_predict_layers 1 (no MTP weights).
* ``deepseek_v2`` DeepseekV2ForCausalLM shaped like DeepSeek-V2-Lite:
  q_lora_rank null (plain q_proj), v_head_dim 8 (!= qk_nope_head_dim 16, so
  a swapped k/v split fails), 8 routed experts, top-3, n_shared_experts 2,
  topk_method "group_limited_greedy" with n_group 4 / topk_group 2,
  scoring_func "softmax", norm_topk_prob false, routed_scaling_factor 1.5,
  yarn as deepseek_v3 but mscale = mscale_all_dim = 0.707 (V2-Lite's);
  otherwise as deepseek_v3.

Sizes are kept small so all families (safetensors and GGUF, float32)
stay at a few MB; the DeepSeek directories are ~1.2-1.3 MB (hidden 64 and
vocab 320 untied, written twice, leave no room under 1 MB at 3 layers).

Weights
-------
``model = ModelClass(config)`` (eager attention, float32), then EVERY
parameter is overwritten, in ``named_parameters()`` order, from one
``torch.Generator`` seeded with the family's weight seed:

* names ending ``norm.weight`` (all RMSNorms, incl. q_norm/k_norm and the
  final norm): ``1 + 0.2*N(0,1)``; for gemma3, whose RMSNorm computes
  ``x * (1 + w)``, ``0.2*N(0,1)`` (so a forgotten +1 changes the logits);
* names ending ``.bias`` (qwen2's q/k/v): ``0.2*N(0,1)``;
* embeddings and lm_head: ``0.3*N(0,1)``, except gemma3: ``0.05*N(0,1)``
  (Gemma multiplies the embeddings by sqrt(hidden) = 8 and ties them to the
  output; at 0.3 every greedy step picked the same token); every other matrix,
  the 3-D fused expert tensors and the MoE routers: ``0.15*N(0,1)``.

Then the buffers that are weights, in ``named_buffers()`` order from the same
generator: DeepSeek-V3's ``mlp.gate.e_score_correction_bias`` (an
``nn.Buffer``, saved in the checkpoint, zero after init): ``0.2*N(0,1)``.

The weight seed starts at the family's base seed and is increased by one until
the smallest top-1/top-2 logit gap along both greedy paths is >= 1e-3 and each
greedy path has >= 8 distinct tokens (recorded as ``seeds.attempts``), so
greedy comparisons are not flaky and not trivially repetitive.

Files per family
----------------
* ``config.json`` / ``generation_config.json``: exactly what
  ``model.save_pretrained`` (transformers 5.23.0) writes (v5 style:
  ``rope_parameters`` holding rope_theta and rope_type, ``dtype``, and for
  qwen3_moe ``num_local_experts``). Before saving, ``model.generation_config``
  is set to ``GenerationConfig(bos_token_id, eos_token_id=[...],
  pad_token_id)`` with the family's end-of-turn token among the eos ids
  (llama3 [<|end_of_text|>, <|eot_id|>]; qwen* [<|im_end|>, <|endoftext|>];
  gemma3 [<eos>, <end_of_turn>]; mistral/mixtral </s>; deepseek_*
  <｜end▁of▁sentence｜>).
* ``config_v4.json``: the same config as transformers 4 wrote it (what most
  hub checkpoints carry). Differences from ``config.json``, and nothing else:
  - ``rope_parameters`` is removed; ``rope_theta`` goes to the top level and
    ``rope_scaling`` is the rest of the dict (with ``rope_type``) or ``null``
    when rope_type is ``default``;
  - gemma3: ``rope_theta`` = full_attention theta, ``rope_local_base_freq`` =
    sliding_attention theta, ``rope_scaling`` = the full_attention scaling,
    ``sliding_window_pattern`` = 6 and no ``layer_types`` (nor the private
    ``_sliding_window_pattern``);
  - ``layer_types`` is also dropped where every layer is full_attention
    (qwen2, qwen3);
  - qwen3_moe: ``num_local_experts`` -> ``num_experts``;
  - deepseek_*: ``head_dim`` and ``qk_head_dim`` dropped (the config class
    derives them; hub DeepSeek configs carry neither);
  - ``dtype`` -> ``torch_dtype``; ``transformers_version`` removed.
  The script loads a directory with config_v4.json as its config.json and
  checks it gives bit-identical logits.
* weights in the hub layout (transformers 4 names), written by this script
  from ``model.state_dict()`` with ``safetensors.torch.save_file`` (metadata
  ``{"format": "pt"}``), float32. Tied models have no ``lm_head.weight``.
  transformers 5 keeps MoE experts fused (``mlp.experts.gate_up_proj``
  [E, 2*I, H] with gate rows first, ``mlp.experts.down_proj`` [E, H, I]); they
  are split back into per-expert tensors: qwen3_moe
  ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` and router
  ``model.layers.N.mlp.gate.weight``; deepseek_* the same per-expert names
  plus ``mlp.shared_experts.{gate,up,down}_proj.weight``, the dense first
  layer's ``mlp.{gate,up,down}_proj.weight``, the MLA tensors
  (``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj``) and for V3
  ``mlp.gate.e_score_correction_bias`` [E]; mixtral
  ``model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight`` (w1 gate,
  w3 up, w2 down) and router ``model.layers.N.block_sparse_moe.gate.weight``.
  qwen3_moe is sharded in two (``model-0000K-of-00002.safetensors`` +
  ``model.safetensors.index.json`` with ``metadata.total_size`` /
  ``total_parameters`` and ``weight_map``), the others are one
  ``model.safetensors``. (transformers 5.23's own ``save_pretrained`` also
  writes these per-expert names; the script checks its tensors equal ours.)
* tokenizer: ONE byte-level BPE trained with ``tokenizers`` (BpeTrainer,
  vocab_size 300 = 256 byte symbols + 44 merges, ByteLevel pre-tokenizer,
  initial alphabet = all 256 byte symbols) on ``TRAINING_TEXT`` below. Per
  family the same vocab and merges get (a) the family's pre-tokenizer:
  llama3 ``Split(<Llama-3 regex>, isolated)`` + ``ByteLevel(use_regex=False)``
  with ``ignore_merges: true``; qwen* NFC normalizer + ``Split(<Qwen2 regex>)``
  + ``ByteLevel(use_regex=False)``; gemma3/mistral/mixtral plain
  ``ByteLevel`` (GPT-2 regex); (real Gemma/Mistral tokenizers are
  SentencePiece, which a byte-level fixture cannot be); (b) the family's
  special tokens appended from id 300 (see ``SPECIALS``); qwen's ``<think>``
  and ``</think>`` are added non-special, as in real Qwen3; gemma3 also gets
  ``<unused0..14>`` so it has exactly 320 tokens (see the GGUF notes);
  (c) a ``TemplateProcessing`` post-processor prepending BOS for llama3,
  gemma3, mistral, mixtral and deepseek_*. DeepSeek gets plain ``ByteLevel``
  too (real DeepSeek tokenizers split with their own regexes, llama.cpp
  pre "deepseek-llm" / "deepseek-v3", not reproduced here) and the specials
  <｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>, <｜User｜>, <｜Assistant｜>,
  <｜▁pad▁｜> (ids 300-304). ``tokenizer_config.json`` is written by this
  script: ``tokenizer_class`` PreTrainedTokenizerFast, ``bos_token`` (where
  the family has one), ``eos_token``, ``pad_token``, ``add_bos_token``,
  ``add_eos_token`` false, ``added_tokens_decoder``, ``model_max_length`` 256
  and ``chat_template`` (templates below, written for these fixtures in each
  family's turn format; not copied from a model).
* ``reference.npz``: ``ids_0``/``ids_1`` int32 prompts (lengths 7 and 40,
  ``np.random.default_rng(prompt_seed).integers(0, 300)``, i.e. no special
  token), ``greedy_0``/``greedy_1`` int32 (32 tokens from
  ``model.generate(do_sample=False, max_new_tokens=32, eos_token_id=None)``
  with ``model.generation_config.eos_token_id = None`` as in
  make_reference_fixtures.py, so generation never stops early),
  ``logits_0``/``logits_1`` float32 [len(prompt)+32, 320] from ONE cache-free
  forward (``use_cache=False``, eager attention) over prompt + greedy tokens.
* ``reference.json``: versions, seeds, shapes, the min gaps, special token
  ids, chat-template renderings (``apply_chat_template``; llama3 is given
  ``date_string`` so its rendering is reproducible; errors are recorded as
  ``error``), tokenizer examples, hub tensor names/shapes, sha256 of every
  file, the GGUF metadata / tensor shapes / notes, and ``ablations``: how far
  the logits move (max |diff|, number of greedy argmax changes) when one
  config detail is dropped (``ABLATIONS``: llama3 rope scaling, qwen2 yarn,
  gemma3 sliding window / query_pre_attn_scalar / global linear scaling /
  local rope theta, mistral sliding window, qwen3_moe norm_topk_prob;
  deepseek_v3 latent norm weight, rope interleave, mscale, yarn, shared
  expert, group limit, bias correction, norm_topk_prob, routed scaling;
  deepseek_v2 latent norm weight, mscale, shared experts, group limit,
  routed scaling), so an engine that ignores one of them fails the
  comparison. An ablation may also overwrite tensors (``"_state"``: name
  suffix -> fill value, e.g. kv_a_layernorm.weight = 1, shared expert
  down_proj = 0, e_score_correction_bias = 0) instead of config keys.
* ``model.gguf`` (llama3, qwen2, qwen3, gemma3, qwen3_moe, deepseek_v3,
  deepseek_v2); see below.
* ``reference_gguf.npz`` (deepseek_v2 only): ``logits_0``/``logits_1`` of
  the HF model as its GGUF describes it to llama.cpp (no group limit:
  n_group = topk_group = 1), over the same ids + greedy tokens as
  reference.npz; reference.json's ``gguf.reference_logits`` says so.
* ``.gitignore`` (in families/): un-ignores ``*.gguf``/``*.safetensors``,
  which the repository's top-level .gitignore ignores.

GGUF: llama.cpp's converter conventions
----------------------------------------
Written with ``gguf.GGUFWriter`` (all tensors F32, general.file_type 0 =
ALL_F32), following ggml-org/llama.cpp's ``convert_hf_to_gguf.py`` (ModelBase,
TextModel, ``_set_vocab_gpt2``/``get_vocab_base``; the per-family classes as
split out in ``conversion/llama.py``, ``conversion/qwen.py``,
``conversion/gemma.py``), the tensor / key names of
``gguf-py/gguf/{constants,tensor_mapping,vocab}.py`` (the ``gguf`` package in
the reference venv is that gguf-py; its ``get_tensor_name_map`` and
``SpecialVocab`` are called directly), and for what the runtime reads
``src/llama-model.cpp`` (gemma3 hparams), ``src/models/qwen3moe.cpp`` and
``src/llama-vocab.cpp`` (pre-tokenizer regexes):

* hparams come from ``AutoConfig.from_pretrained(dir).to_dict()``
  (``ModelBase.load_hparams``), i.e. v5 ``rope_parameters``.
* keys (``TextModel.set_gguf_parameters``): ``general.architecture``,
  ``general.type`` = model, ``general.name`` = family, then
  ``{arch}.block_count``, ``.context_length``, ``.embedding_length``,
  ``.feed_forward_length``, ``.attention.head_count``,
  ``.attention.head_count_kv``, rope scaling (below), ``.rope.freq_base``,
  ``.rope.freq_base_swa`` (a ``sliding_attention`` theta exists),
  ``.attention.layer_norm_rms_epsilon``, ``.expert_count`` /
  ``.expert_used_count`` (MoE), ``.attention.key_length`` /
  ``.attention.value_length`` (only when hparams has ``head_dim``: not
  qwen2), ``general.file_type``, ``general.quantization_version`` = 2.
  ``LlamaModel`` adds ``llama.vocab_size`` and ``llama.rope.dimension_count``
  (head_dim); ``Qwen2MoeModel``/``Qwen3MoeModel`` add
  ``.expert_feed_forward_length`` (moe_intermediate_size); ``Gemma3Model``
  adds ``gemma3.attention.sliding_window`` (its hparams have no
  ``sliding_window_pattern``, so != 1) and writes no softcapping (null).
* rope scaling (base.py): ``linear`` -> ``.rope.scaling.type`` "linear" +
  ``.rope.scaling.factor``; ``yarn`` -> type "yarn", factor,
  ``.rope.scaling.original_context_length`` (no attn/ext/beta keys: the
  config has none); ``llama3`` -> no keys, but ``LlamaModel.
  generate_extra_tensors`` emits ``rope_freqs.weight`` (F32 [head_dim/2]):
  per frequency 1 (wavelen < orig/high_freq_factor), factor (wavelen >
  orig/low_freq_factor) or ``1/((1-s)/factor + s)`` with ``s = (orig/wavelen
  - low)/(high - low)``; llama.cpp divides the frequency by it. NOTE: the
  converter reads ``orig`` from the TOP-LEVEL hparam
  ``original_max_position_embeddings`` with default 8192; transformers 5
  keeps it only inside rope_parameters, so the converter would silently use
  8192 (right for every real Llama 3.1/3.2, wrong for this fixture's 32).
  We use 32, the value the HF model uses, so the GGUF is the same model.
  For gemma3 the scaling written is the ``full_attention`` one (linear 8) and
  llama.cpp applies it to global layers only (``rope_freq_scale_train_swa =
  1``, llama-model.cpp).
* tensors: names from ``get_tensor_name_map(arch, n_layer)``
  (token_embd, blk.N.attn_norm / attn_q / attn_k / attn_v / attn_output /
  attn_q_norm / attn_k_norm / ffn_norm / ffn_gate / ffn_up / ffn_down /
  post_attention_norm / post_ffw_norm / ffn_gate_inp / ffn_*_exps,
  output_norm, output) with ``.weight``/``.bias``; numpy arrays keep the
  PyTorch [out, in] order (GGUF stores ne reversed).
  - ``llama``: q_proj/k_proj rows are permuted (``LlamaModel.permute``:
    reshape(n_head, 2, rows/n_head/2, in).swapaxes(1, 2), with n_head =
    n_head_kv for k) to llama.cpp's rotate-adjacent-pairs RoPE. Not for
    qwen2/qwen3/qwen3moe/gemma3 (NEOX rope in llama.cpp).
  - gemma3: +1 on every tensor whose name ends ``norm.weight``
    (``Gemma3Model.norm_shift``); token_embd is cut to len(tokenizer.json
    vocab) + len(added_tokens) rows, which is why the gemma3 tokenizer is
    padded with ``<unusedN>`` to exactly 320 (otherwise the embedding would
    lose rows while the token list keeps 320 entries).
  - tied embeddings: no ``lm_head.weight`` in the checkpoint, so no
    ``output.weight`` (llama.cpp falls back to token_embd).
  - qwen3moe (``Qwen2MoeModel.modify_tensors``): per-expert tensors are
    ``torch.stack``-ed over experts: ``ffn_gate_exps``/``ffn_up_exps``
    numpy (E, I, H), ``ffn_down_exps`` (E, H, I); router -> ``ffn_gate_inp``
    (E, H).
* tokenizer (``_set_vocab_gpt2`` / ``get_vocab_base``):
  ``tokenizer.ggml.model`` "gpt2"; ``tokenizer.ggml.tokens`` = the vocab in id
  order padded to vocab_size with ``[PAD{i}]``; ``token_type`` 1 NORMAL, 3
  CONTROL (special added tokens), 4 USER_DEFINED (non-special added: <think>),
  5 UNUSED (padding); ``tokenizer.ggml.merges``, bos/eos/padding ids,
  ``add_bos_token``/``add_eos_token`` and ``tokenizer.chat_template`` come
  from ``gguf.SpecialVocab(dir, load_merges=True)``.
  ``tokenizer.ggml.pre``: the converter identifies it by hashing the token ids
  of a fixed text, which matches no known model for this tiny vocab (it would
  raise NotImplementedError). We write the name llama.cpp uses for the regex
  the tokenizer really has: llama3 "llama-bpe" (LLAMA3 regex), qwen* "qwen2",
  gemma3 "gpt-2" (real Gemma GGUFs are SentencePiece, model "llama").
* where llama.cpp's converter/runtime refuses or loses something:
  - gemma3: ``query_pre_attn_scalar`` is not stored (llama.cpp uses
    1/sqrt(head_dim), or 1/sqrt(n_embd/n_head) for the 27B), so with 24 !=
    head_dim llama.cpp itself would not reproduce the HF logits; the sliding
    pattern is not stored either (llama.cpp hard-codes 6 for gemma3, which
    this config matches); the swa rope base is also hard-coded 1e4 there.
  - qwen3_moe: llama.cpp's converter would refuse dense mlp_only_layers
    ("Can not map tensor"; its runtime needs experts in every layer), so the
    fixture has none; a dense layer would be written as ``blk.N.ffn_gate``...
  - mistral: skipped; LlamaModel would write arch ``llama`` and drop
    sliding_window, i.e. a different model.
  - mixtral: skipped (``LlamaModel`` would stack block_sparse_moe experts into
    ffn_*_exps and permute Q/K; easy, left out to keep the fixtures small).

GGUF: DeepSeek (arch ``deepseek2``)
-----------------------------------
``DeepseekV2Model`` in llama.cpp's ``conversion/deepseek.py`` serves both
DeepseekV2ForCausalLM and DeepseekV3ForCausalLM; the runtime side read is
``src/llama-model.cpp`` (LLM_ARCH_DEEPSEEK2 hparams), ``src/models/
deepseek2.cpp`` and ``llm_graph_context::build_moe_ffn`` (llama-graph.cpp).
Both files: vocab as above (``_set_vocab_gpt2`` is tried first), no Q/K
permutation (deepseek2 uses LLAMA_ROPE_TYPE_NORM: adjacent rotary pairs,
i.e. rope_interleave), experts stacked as qwen3moe (``ffn_{gate,up}_exps``
numpy (E, I, H), ``ffn_down_exps`` (E, H, I)), router ``ffn_gate_inp``
(E, H), ``e_score_correction_bias`` renamed ``e_score_correction.bias``
(base.py ``filter_tensors``) -> ``exp_probs_b.bias`` (E,), shared experts
``ffn_{gate,up,down}_shexp``, dense layers ``ffn_{gate,up,down}``, MLA
``attn_q`` (no q-LoRA) or ``attn_q_a``/``attn_q_a_norm``/``attn_q_b``,
``attn_kv_a_mqa`` (kv_lora_rank + qk_rope rows), ``attn_kv_a_norm``,
``attn_output``. Two styles:

* deepseek_v3, ``style="mla"``: as the current converter writes it.
  ``TextModel.set_gguf_parameters`` after the class sets num_key_value_heads
  = 1 (``head_count_kv`` 1: MLA as MQA), yarn keys from rope_parameters
  (type, factor, original_context_length, yarn_beta_fast, yarn_beta_slow;
  no attn/ext factor: the config has none), ``expert_count``,
  ``expert_used_count``, ``expert_group_count`` (n_group),
  ``expert_group_used_count`` (topk_group), ``expert_gating_func``
  (scoring_func: 1 softmax, 2 sigmoid); then the class:
  ``leading_dense_block_count``, ``vocab_size``, ``attention.q_lora_rank``
  (only when set), ``attention.kv_lora_rank``, ``attention.key_length`` =
  kv_lora_rank + qk_rope, ``attention.value_length`` = kv_lora_rank,
  ``attention.key_length_mla`` = qk_nope + qk_rope,
  ``attention.value_length_mla`` = v_head_dim,
  ``expert_feed_forward_length``, ``expert_count`` (again),
  ``expert_shared_count``, ``expert_weights_scale`` (routed_scaling_factor),
  ``expert_weights_norm`` (only when norm_topk_prob is true),
  ``rope.dimension_count`` = qk_rope_head_dim and
  ``rope.scaling.yarn_log_multiplier`` = 0.1 * mscale_all_dim (written in
  place of mscale/mscale_all_dim; [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX], llama.cpp
  PR 17945). ``kv_b_proj`` is split (``modify_tensors``): viewed (H, qk_nope
  + v, kv_lora_rank), split on dim 1 into k_b (H, qk_nope, r) and v_b
  (H, v, r); ``attn_k_b`` = k_b.transpose(1, 2): numpy (H, r, qk_nope);
  ``attn_v_b``: numpy (H, v, r).
* deepseek_v2, ``style="legacy"``: as ``DeepseekV2Model`` wrote DeepSeek-V2
  files before the DeepSeek-V3 additions (expert_gating_func,
  expert_weights_norm, exp_probs_b, group keys) and before the MLA
  absorption (kv_b split, *_mla keys, head_count_kv 1): ``head_count_kv`` =
  num_key_value_heads (= heads), ``expert_used_count``, then the class:
  leading_dense_block_count, vocab_size, (q_lora_rank when set),
  kv_lora_rank, ``key_length`` = qk_nope + qk_rope, ``value_length`` =
  v_head_dim, expert_feed_forward_length, expert_count, expert_shared_count,
  expert_weights_scale, rope.dimension_count, rope.scaling.type yarn /
  factor / original_context_length / yarn_log_multiplier; one whole
  ``attn_kv_b`` (H*(qk_nope + v), r). No beta keys (llama.cpp's defaults
  32 / 1 equal this config's), no gating func (llama.cpp defaults softmax),
  no weights_norm (false), no group keys.
* what llama.cpp's format loses (reference.json ``gguf.notes``): mscale
  (only mscale_all_dim, via yarn_log_multiplier; llama.cpp assumes mscale ==
  mscale_all_dim, so the fixtures keep them equal and the script refuses
  otherwise); rope_interleave (always adjacent pairs); topk_method (llama.cpp
  scores a group by its top-2 sum, V3's noaux_tc; V2's group_limited_greedy
  uses the group max); in the legacy file the group limit itself (llama.cpp
  then routes without it: the GGUF is the HF model with n_group =
  topk_group = 1, whose logits are reference_gguf.npz); q_lora_rank is
  absent without q-LoRA, which llama.cpp's loader (as read) requires unless
  n_layer == 27 (V2-Lite), so llama.cpp itself would refuse the 3-layer V2
  file. The MTP layers (num_nextn_predict_layers) are skipped by the
  converter (``skip_mtp``); these models have none.

Checks (all must pass or the script fails)
------------------------------------------
* every greedy token is the argmax of the cache-free logits at the previous
  position; min top-1/top-2 gap >= 1e-3 on both greedy paths;
* ``from_pretrained`` of the written directory (and of a copy using
  config_v4.json as config.json) reproduces the recorded logits
  bit-identically; the hub tensors equal those of transformers'
  ``save_pretrained``;
* ``AutoTokenizer.from_pretrained`` encodes like the ``tokenizers`` object;
  gemma3's template raises on non-alternating roles; every ablation moves
  some logit by >= 1e-2; BPE training gives the same tokenizer twice;
* each ``model.gguf`` re-opened with ``gguf.GGUFReader`` has the expected
  keys and tensors; tensors are compared with the hub tensors after undoing
  the permutation / +1 / stacking; deepseek2: every key above with its
  value (and the legacy file's absent keys absent), attn_k_b / attn_v_b
  rebuild kv_b_proj exactly.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import tempfile

import numpy as np
import torch
import gguf
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers
import transformers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                          DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO_ROOT, "tests", "fixtures", "families")

BASE_VOCAB = 300          # trained byte-level BPE: 256 bytes + 44 merges
VOCAB_SIZE = 320          # model vocab_size (covers BPE + specials)
PROMPT_LENS = (7, 40)
NEW_TOKENS = 32
MIN_GAP = 1e-3
MIN_DISTINCT_GREEDY = 8   # reject seeds whose greedy path collapses onto a few tokens
MAX_SEED_ATTEMPTS = 64
STD_EMBED = 0.3
STD_MATRIX = 0.15
STD_NORM = 0.2
STD_BIAS = 0.2
LLAMA3_DATE = "26 Jul 2024"

# Written for these fixtures; plain English with digits and contractions.
TRAINING_TEXT = """\
The little harbour town wakes up slowly. At six o'clock the first boats leave
the quay, and by seven the bakery on the corner has sold its first 40 loaves.
Children walk to school along the sea wall, counting the gulls that sit on the
posts: 3, 7, 12, then they lose count and start again. Their teacher says it's
fine to lose count, as long as you don't lose your way.

In the afternoon the wind turns. The sailors watch the sky and talk about the
weather they remember: the storm of 1987, the winter when the bay froze, the
summer with no rain at all. They're proud of those stories and they'll tell
them to anyone who sits down on the bench beside them.

A small library stands behind the market. It has 2,500 books, three tables and
one old clock that is always 5 minutes late. The librarian keeps a list of the
books that were borrowed and never returned; the oldest entry is from 1952.
She doesn't mind. She thinks a book that never comes back has found a reader
who needed it more.

On market day the square is full. There are apples and pears, fresh fish,
cheese from the farms on the hill, honey, bread, and flowers in buckets of
water. Prices are written on small boards: 2 for 1, 3 for 5, 10 percent off
after noon. People argue about the price of tomatoes and then buy them anyway.

When the evening comes, the lights go on one by one along the water. The
boats come back, the nets are hung to dry, and the town grows quiet again. The
last sound is usually the bell of the church, which rings 9 times at nine
o'clock, and then the only thing you can hear is the sea.

Questions worth asking: what is the time, where is the station, how far is it
to the next town, and would you like a cup of tea? Yes, please. No, thank you.
We've been here before; you'd like it, I'm sure, and we'd be happy to show you.
"""

# Pre-tokenizer regexes as the real tokenizer.json files spell them.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# --------------------------------------------------------------------------
# Chat templates (written for these fixtures, in each family's turn format)
# --------------------------------------------------------------------------

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages and messages[0].role == "system" %}
    {%- set system_text = messages[0].content | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = "" %}
    {%- set turns = messages %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n" }}
{%- if tools is defined and tools %}
    {{- "\\nYou can call these functions. To call one, answer with JSON: {\\"name\\": <name>, \\"parameters\\": <arguments>}.\\n" }}
    {%- for tool in tools %}
        {{- "\\n" + (tool | tojson) + "\\n" }}
    {%- endfor %}
{%- endif %}
{%- if system_text %}
    {{- "\\n" + system_text }}
{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in turns %}
    {%- set role = "ipython" if message.role == "tool" else message.role %}
    {{- "<|start_header_id|>" + role + "<|end_header_id|>\\n\\n" }}
    {%- if message.tool_calls is defined and message.tool_calls %}
        {%- for call in message.tool_calls %}
            {{- {"name": call.function.name, "parameters": call.function.arguments} | tojson }}
        {%- endfor %}
    {%- else %}
        {{- message.content | trim }}
    {%- endif %}
    {{- "<|eot_id|>" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}
{%- endif %}
"""

QWEN2_TEMPLATE = """\
{%- if messages and messages[0].role == "system" %}
    {{- "<|im_start|>system\\n" + messages[0].content + "<|im_end|>\\n" }}
{%- else %}
    {{- "<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (loop.first and message.role == "system") %}
        {{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\\n" }}
{%- endif %}
"""

QWEN3_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "system" %}
        {%- if loop.first %}
            {{- "<|im_start|>system\\n" + message.content + "<|im_end|>\\n" }}
        {%- endif %}
        {%- continue %}
    {%- endif %}
    {%- if message.role != "assistant" %}
        {{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" }}
        {%- continue %}
    {%- endif %}
    {%- set answer = message.content %}
    {%- set thought = "" %}
    {%- if "</think>" in answer %}
        {%- set thought = answer.split("</think>")[0].split("<think>")[-1].strip("\\n") %}
        {%- set answer = answer.split("</think>")[-1].lstrip("\\n") %}
    {%- endif %}
    {{- "<|im_start|>assistant\\n" }}
    {%- if thought and loop.index0 > ns.last_user %}
        {{- "<think>\\n" + thought + "\\n</think>\\n\\n" }}
    {%- endif %}
    {{- answer + "<|im_end|>\\n" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\\n" }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- "<think>\\n\\n</think>\\n\\n" }}
    {%- endif %}
{%- endif %}
"""

GEMMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages and messages[0].role == "system" %}
    {%- set preamble = messages[0].content | trim + "\\n\\n" %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set preamble = "" %}
    {%- set turns = messages %}
{%- endif %}
{%- for message in turns %}
    {%- if (message.role == "user") != (loop.index0 % 2 == 0) %}
        {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- set role = "model" if message.role == "assistant" else message.role %}
    {{- "<start_of_turn>" + role + "\\n" }}
    {%- if loop.first %}
        {{- preamble }}
    {%- endif %}
    {{- message.content | trim + "<end_of_turn>\\n" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<start_of_turn>model\\n" }}
{%- endif %}
"""

MISTRAL_TEMPLATE = """\
{{- bos_token }}
{%- if messages and messages[0].role == "system" %}
    {%- set preamble = messages[0].content + "\\n\\n" %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set preamble = "" %}
    {%- set turns = messages %}
{%- endif %}
{%- for message in turns %}
    {%- if message.role == "user" %}
        {{- "[INST] " + (preamble if loop.first else "") + message.content + " [/INST]" }}
    {%- elif message.role == "assistant" %}
        {{- " " + message.content + eos_token }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported after the system message") }}
    {%- endif %}
{%- endfor %}
"""

DEEPSEEK_TEMPLATE = """\
{{- bos_token }}
{%- set ns = namespace(system="") %}
{%- for message in messages %}
    {%- if message.role == "system" %}
        {%- set ns.system = ns.system + ("\\n\\n" if ns.system else "") + message.content %}
    {%- endif %}
{%- endfor %}
{{- ns.system }}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- "<｜User｜>" + message.content }}
    {%- elif message.role == "assistant" %}
        {%- set answer = message.content %}
        {%- if "</think>" in answer %}
            {%- set answer = answer.split("</think>")[-1] %}
        {%- endif %}
        {{- "<｜Assistant｜>" + answer + eos_token }}
    {%- elif message.role != "system" %}
        {{- raise_exception("Only system, user and assistant roles are supported") }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<｜Assistant｜>" }}
{%- endif %}
"""

QWEN_SPECIALS = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                 ("<think>", False), ("</think>", False)]
MISTRAL_SPECIALS = [("<s>", True), ("</s>", True), ("[INST]", True), ("[/INST]", True)]
DEEPSEEK_SPECIALS = [("<｜begin▁of▁sentence｜>", True), ("<｜end▁of▁sentence｜>", True),
                     ("<｜User｜>", True), ("<｜Assistant｜>", True), ("<｜▁pad▁｜>", True)]

# (content, special) in id order from BASE_VOCAB.
SPECIALS = {
    "llama3": [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
               ("<|end_header_id|>", True), ("<|eot_id|>", True)],
    "qwen2": QWEN_SPECIALS,
    "qwen3": QWEN_SPECIALS,
    "qwen3_moe": QWEN_SPECIALS,
    "gemma3": ([("<pad>", True), ("<eos>", True), ("<bos>", True), ("<start_of_turn>", True),
                ("<end_of_turn>", True)]
               + [(f"<unused{i}>", True) for i in range(VOCAB_SIZE - BASE_VOCAB - 5)]),
    "mistral": MISTRAL_SPECIALS,
    "mixtral": MISTRAL_SPECIALS,
    "deepseek_v3": DEEPSEEK_SPECIALS,
    "deepseek_v2": DEEPSEEK_SPECIALS,
}

QWEN_TOK = dict(pretok="qwen2", bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False,
                config_ids=dict(bos="<|endoftext|>", eos="<|im_end|>", pad=None),
                gen_ids=dict(bos="<|endoftext|>", eos=["<|im_end|>", "<|endoftext|>"], pad="<|endoftext|>"))
MISTRAL_TOK = dict(pretok="gpt2", bos="<s>", eos="</s>", pad=None, add_bos=True,
                   config_ids=dict(bos="<s>", eos="</s>", pad=None),
                   gen_ids=dict(bos="<s>", eos="</s>", pad=None))
DEEPSEEK_TOK = dict(pretok="gpt2", bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>",
                    pad="<｜▁pad▁｜>", add_bos=True,
                    config_ids=dict(bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad=None),
                    gen_ids=dict(bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>",
                                 pad="<｜▁pad▁｜>"))

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=64, vocab_size=VOCAB_SIZE, max_position_embeddings=256,
              num_hidden_layers=2)
# DeepSeek (MLA): head_dim is derived (= qk_rope_head_dim) and num_key_value_heads must equal
# num_attention_heads (kv_b_proj makes one key/value per query head; transformers repeats kv
# heads by num_attention_heads // num_key_value_heads on top of that).
DEEPSEEK_COMMON = dict({k: v for k, v in COMMON.items() if k != "head_dim"}, num_key_value_heads=4,
                       num_hidden_layers=3, intermediate_size=32, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, kv_lora_rank=32, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, moe_intermediate_size=8,
                       first_k_dense_replace=1)

FAMILIES = {
    "llama3": dict(
        config_cls=LlamaConfig, model_cls=LlamaForCausalLM, base_seed=1000, prompt_seed=11,
        config=dict(COMMON, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32}),
        tok=dict(pretok="llama3", bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, add_bos=True,
                 config_ids=dict(bos="<|begin_of_text|>", eos=["<|end_of_text|>", "<|eot_id|>"], pad=None),
                 gen_ids=dict(bos="<|begin_of_text|>", eos=["<|end_of_text|>", "<|eot_id|>"], pad=None)),
        template=LLAMA3_TEMPLATE, zero_centred_norm=False, shards=1,
        gguf=dict(arch=gguf.MODEL_ARCH.LLAMA, pre="llama-bpe")),
    "qwen2": dict(
        config_cls=Qwen2Config, model_cls=Qwen2ForCausalLM, base_seed=2000, prompt_seed=12,
        config=dict({k: v for k, v in COMMON.items() if k != "head_dim"}, rms_norm_eps=1e-6,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 64}),
        tok=QWEN_TOK, template=QWEN2_TEMPLATE, zero_centred_norm=False, shards=1,
        gguf=dict(arch=gguf.MODEL_ARCH.QWEN2, pre="qwen2")),
    "qwen3": dict(
        config_cls=Qwen3Config, model_cls=Qwen3ForCausalLM, base_seed=3000, prompt_seed=13,
        config=dict(COMMON, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        tok=QWEN_TOK, template=QWEN3_TEMPLATE, zero_centred_norm=False, shards=1,
        gguf=dict(arch=gguf.MODEL_ARCH.QWEN3, pre="qwen2")),
    "gemma3": dict(
        config_cls=Gemma3TextConfig, model_cls=Gemma3ForCausalLM, base_seed=4000, prompt_seed=14,
        config=dict(COMMON, num_hidden_layers=6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    query_pre_attn_scalar=24, sliding_window=8,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"],
                    hidden_activation="gelu_pytorch_tanh",
                    final_logit_softcapping=None, attn_logit_softcapping=None,
                    rope_parameters={
                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        tok=dict(pretok="gpt2", bos="<bos>", eos="<eos>", pad="<pad>", add_bos=True,
                 config_ids=dict(bos="<bos>", eos=["<eos>", "<end_of_turn>"], pad="<pad>"),
                 gen_ids=dict(bos="<bos>", eos=["<eos>", "<end_of_turn>"], pad="<pad>")),
        template=GEMMA3_TEMPLATE, zero_centred_norm=True, shards=1, std_embed=0.05,
        gguf=dict(arch=gguf.MODEL_ARCH.GEMMA3, pre="gpt-2")),
    "mistral": dict(
        config_cls=MistralConfig, model_cls=MistralForCausalLM, base_seed=5000, prompt_seed=15,
        config=dict(COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=12,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        tok=MISTRAL_TOK, template=MISTRAL_TEMPLATE, zero_centred_norm=False, shards=1,
        gguf=None,
        gguf_skip=("llama.cpp's converter writes MistralForCausalLM as arch 'llama' (LlamaModel), which "
                   "has no sliding window: the GGUF would be a different model (full attention)")),
    "qwen3_moe": dict(
        config_cls=Qwen3MoeConfig, model_cls=Qwen3MoeForCausalLM, base_seed=6000, prompt_seed=16,
        config=dict(COMMON, num_hidden_layers=3, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[],
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        tok=QWEN_TOK, template=QWEN3_TEMPLATE, zero_centred_norm=False, shards=2,
        gguf=dict(arch=gguf.MODEL_ARCH.QWEN3MOE, pre="qwen2")),
    "mixtral": dict(
        config_cls=MixtralConfig, model_cls=MixtralForCausalLM, base_seed=7000, prompt_seed=17,
        config=dict(COMMON, intermediate_size=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        tok=MISTRAL_TOK, template=MISTRAL_TEMPLATE, zero_centred_norm=False, shards=1,
        gguf=None,
        gguf_skip=("not needed: llama.cpp writes Mixtral as arch 'llama' (LlamaModel stacks "
                   "block_sparse_moe.experts.E.w1/w2/w3 into ffn_gate/down/up_exps and permutes Q/K); "
                   "left out to keep the fixtures small")),
    "deepseek_v3": dict(
        config_cls=DeepseekV3Config, model_cls=DeepseekV3ForCausalLM, base_seed=8000, prompt_seed=18,
        config=dict(DEEPSEEK_COMMON, q_lora_rank=24, n_shared_experts=1, num_experts_per_tok=2,
                    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                    rope_interleave=True, scoring_func="sigmoid", topk_method="noaux_tc",
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
        tok=DEEPSEEK_TOK, template=DEEPSEEK_TEMPLATE, zero_centred_norm=False, shards=1,
        gguf=dict(arch=gguf.MODEL_ARCH.DEEPSEEK2, pre="gpt-2", style="mla")),
    "deepseek_v2": dict(
        config_cls=DeepseekV2Config, model_cls=DeepseekV2ForCausalLM, base_seed=9000, prompt_seed=19,
        config=dict(DEEPSEEK_COMMON, q_lora_rank=None, v_head_dim=8, n_shared_experts=2,
                    num_experts_per_tok=3,
                    n_group=4, topk_group=2, topk_method="group_limited_greedy", scoring_func="softmax",
                    norm_topk_prob=False, routed_scaling_factor=1.5,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
        tok=DEEPSEEK_TOK, template=DEEPSEEK_TEMPLATE, zero_centred_norm=False, shards=1,
        gguf=dict(arch=gguf.MODEL_ARCH.DEEPSEEK2, pre="gpt-2", style="legacy",
                  same_as={"n_group": 1, "topk_group": 1})),
}

# Config changes that a wrong engine might effectively make; the script records
# how far each moves the logits (and checks that it does), so the fixtures are
# known to catch the mistake.
ABLATIONS = {
    "llama3": {"no llama3 rope scaling": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
    "qwen2": {"no yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}},
    "qwen3": {},
    "gemma3": {
        "no sliding window": {"layer_types": ["full_attention"] * 6},
        "query_pre_attn_scalar = head_dim": {"query_pre_attn_scalar": 16},
        "no linear scaling on global layers": {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        "local rope theta = global": {"rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
    },
    "mistral": {"no sliding window": {"sliding_window": None}},
    "qwen3_moe": {"norm_topk_prob false": {"norm_topk_prob": False}},
    "mixtral": {},
    # "_state": {name suffix: value} fills those tensors of the copied state_dict (parameters and
    # persistent buffers) instead of changing the config.
    "deepseek_v3": {
        "latent norm weight = 1 (kv_a_layernorm)": {"_state": {"kv_a_layernorm.weight": 1.0}},
        "rope not interleaved": {"rope_interleave": False},
        "no mscale (mscale_all_dim dropped)": {"rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0}},
        "no yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        "shared expert off (weights zeroed)": {"_state": {"shared_experts.down_proj.weight": 0.0}},
        "group limit off (n_group 1, topk_group 1)": {"n_group": 1, "topk_group": 1},
        "bias correction off (e_score_correction_bias = 0)": {"_state": {"e_score_correction_bias": 0.0}},
        "norm_topk_prob false": {"norm_topk_prob": False},
        "routed_scaling_factor 1": {"routed_scaling_factor": 1.0},
    },
    "deepseek_v2": {
        "latent norm weight = 1 (kv_a_layernorm)": {"_state": {"kv_a_layernorm.weight": 1.0}},
        "no mscale (mscale_all_dim dropped)": {"rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707}},
        "shared experts off (weights zeroed)": {"_state": {"shared_experts.down_proj.weight": 0.0}},
        "group limit off (n_group 1, topk_group 1)": {"n_group": 1, "topk_group": 1},
        "routed_scaling_factor 1": {"routed_scaling_factor": 1.0},
    },
}

CHAT_CASES = [
    dict(name="system_user", add_generation_prompt=True,
         messages=[{"role": "system", "content": "You are terse."},
                   {"role": "user", "content": "Where is the library?"}]),
    dict(name="multi_turn", add_generation_prompt=True,
         messages=[{"role": "user", "content": "Hello!"},
                   {"role": "assistant", "content": "Hi, how can I help?"},
                   {"role": "user", "content": "What time is it?"}]),
    dict(name="no_generation_prompt", add_generation_prompt=False,
         messages=[{"role": "user", "content": "Say yes."},
                   {"role": "assistant", "content": "Yes."}]),
]
FAMILY_CHAT_CASES = {
    "qwen3": [
        dict(name="thinking_disabled", add_generation_prompt=True, kwargs={"enable_thinking": False},
             messages=[{"role": "user", "content": "Is it raining?"}]),
        dict(name="thinking_enabled", add_generation_prompt=True, kwargs={"enable_thinking": True},
             messages=[{"role": "user", "content": "Is it raining?"}]),
        dict(name="reasoning_history", add_generation_prompt=False,
             messages=[{"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                       {"role": "user", "content": "And 3+3?"},
                       {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"}]),
    ],
    "llama3": [
        dict(name="tools", add_generation_prompt=True,
             kwargs={"tools": [{"type": "function", "function": {
                 "name": "get_time", "description": "Current time in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}}}]},
             messages=[{"role": "user", "content": "Time in Oslo?"}]),
    ],
    "gemma3": [
        dict(name="roles_not_alternating", add_generation_prompt=True,
             messages=[{"role": "user", "content": "One."}, {"role": "user", "content": "Two."}]),
    ],
}
FAMILY_CHAT_CASES["qwen3_moe"] = FAMILY_CHAT_CASES["qwen3"]
FAMILY_CHAT_CASES["deepseek_v3"] = FAMILY_CHAT_CASES["deepseek_v2"] = [
    dict(name="reasoning_history", add_generation_prompt=True,
         messages=[{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                   {"role": "user", "content": "And 3+3?"}]),
    dict(name="tool_role_refused", add_generation_prompt=True,
         messages=[{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}]),
]

TOKENIZER_STRINGS = [
    "The boats come back at 7 o'clock; we've 12345 nets.",
    "  two  spaces\nand a new line",
]


def pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dump_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

def train_base_bpe() -> str:
    """Train the shared byte-level BPE; returns its tokenizer.json text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BASE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != BASE_VOCAB:
        raise RuntimeError(f"BPE vocab has {tok.get_vocab_size()} tokens, expected {BASE_VOCAB}")
    return tok.to_str()


def family_tokenizer(base_json: str, family: str, spec: dict) -> Tokenizer:
    tok = Tokenizer.from_str(base_json)
    pretok = spec["tok"]["pretok"]
    if pretok == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    elif pretok == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                     use_regex=True)
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False,
                        single_word=False) for content, special in SPECIALS[family]]
    # add_tokens keeps the per-token 'special' flag; ids follow the BPE vocab
    tok.add_tokens(added)
    for i, (content, _) in enumerate(SPECIALS[family]):
        if tok.token_to_id(content) != BASE_VOCAB + i:
            raise RuntimeError(f"{family}: {content!r} did not get id {BASE_VOCAB + i}")
    if spec["tok"]["add_bos"]:
        bos = spec["tok"]["bos"]
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    data = json.loads(tok.to_str())
    if pretok == "llama3":
        data["model"]["ignore_merges"] = True
    return Tokenizer.from_str(json.dumps(data))


def tokenizer_config(family: str, spec: dict, tok: Tokenizer) -> dict:
    t = spec["tok"]
    decoder = {}
    for content, special in SPECIALS[family]:
        decoder[str(tok.token_to_id(content))] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}
    return {
        "add_bos_token": bool(t["add_bos"]),
        "add_eos_token": False,
        "added_tokens_decoder": decoder,
        "bos_token": t["bos"],
        "chat_template": spec["template"],
        "clean_up_tokenization_spaces": False,
        "eos_token": t["eos"],
        "model_max_length": 256,
        "pad_token": t["pad"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def token_ids(tok: Tokenizer, names):
    if names is None:
        return None
    if isinstance(names, list):
        return [tok.token_to_id(n) for n in names]
    return tok.token_to_id(names)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

def build_model(spec: dict, tok: Tokenizer, seed: int):
    cfg_kwargs = copy.deepcopy(spec["config"])
    ids = spec["tok"]["config_ids"]
    cfg = spec["config_cls"](**cfg_kwargs, bos_token_id=token_ids(tok, ids["bos"]),
                             eos_token_id=token_ids(tok, ids["eos"]),
                             pad_token_id=token_ids(tok, ids["pad"]))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = spec["model_cls"](cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_((0.0 if spec["zero_centred_norm"] else 1.0) + STD_NORM * noise)
            elif name.endswith(".bias"):
                p.copy_(STD_BIAS * noise)
            elif p.ndim < 2:
                raise RuntimeError(f"no init rule for 1-D parameter {name}")
            elif "embed_tokens" in name or name == "lm_head.weight":
                p.copy_(spec.get("std_embed", STD_EMBED) * noise)
            else:
                p.copy_(STD_MATRIX * noise)
        # then the buffers that are weights: DeepSeek-V3's router correction bias (an nn.Buffer,
        # saved in the checkpoint, zero after init); drawn after every parameter, so the other
        # families' draws are unchanged
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(STD_BIAS * torch.randn(b.shape, generator=g, dtype=torch.float32))
    model.eval()
    gen = spec["tok"]["gen_ids"]
    model.generation_config = GenerationConfig(bos_token_id=token_ids(tok, gen["bos"]),
                                               eos_token_id=token_ids(tok, gen["eos"]),
                                               pad_token_id=token_ids(tok, gen["pad"]))
    return model


@torch.no_grad()
def forward_logits(model, ids: list[int]) -> np.ndarray:
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy().astype(np.float32)


@torch.no_grad()
def greedy_reference(model, prompts: list[list[int]]):
    """Greedy ids, full cache-free logits and gaps for each prompt."""
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    results = []
    try:
        for ids in prompts:
            x = torch.tensor([ids], dtype=torch.long)
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                                 temperature=None, top_p=None, top_k=None,
                                 return_dict_in_generate=True, output_logits=True)
            new = [int(t) for t in out.sequences[0, len(ids):].tolist()]
            if len(new) != NEW_TOKENS:
                raise RuntimeError(f"expected {NEW_TOKENS} new tokens, got {len(new)}")
            logits = forward_logits(model, ids + new)
            rows = logits[len(ids) - 1:len(ids) - 1 + NEW_TOKENS]
            if [int(t) for t in rows.argmax(-1)] != new:
                raise RuntimeError("greedy token is not the argmax of the forward logits")
            top2 = np.sort(rows, axis=-1)[:, -2:]
            gaps = top2[:, 1] - top2[:, 0]
            gen_rows = torch.stack([s[0] for s in out.logits]).float().numpy()
            results.append(dict(ids=ids, greedy=new, logits=logits, min_gap=float(gaps.min()),
                                cache_vs_forward=float(np.abs(gen_rows - rows).max())))
    finally:
        model.generation_config.eos_token_id = saved_eos
    return results


def hub_tensors(family: str, model) -> dict[str, torch.Tensor]:
    """state_dict renamed to the hub (transformers 4) layout, experts split."""
    tied = bool(model.config.tie_word_embeddings)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.float32)
        if name == "lm_head.weight" and tied:
            continue
        m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if m:
            layer, kind = m.groups()
            if family == "mixtral":
                base, (g_name, u_name, d_name) = f"{layer}.block_sparse_moe.experts", ("w1", "w3", "w2")
            else:
                base, (g_name, u_name, d_name) = f"{layer}.mlp.experts", ("gate_proj", "up_proj", "down_proj")
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    half = t.shape[1] // 2
                    out[f"{base}.{e}.{g_name}.weight"] = t[e, :half].clone().contiguous()
                    out[f"{base}.{e}.{u_name}.weight"] = t[e, half:].clone().contiguous()
                else:
                    out[f"{base}.{e}.{d_name}.weight"] = t[e].clone().contiguous()
            continue
        if family == "mixtral" and re.fullmatch(r"model\.layers\.\d+\.mlp\.gate\.weight", name):
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        out[name] = t.clone().contiguous()
    return dict(sorted(out.items()))


def write_safetensors(fam_dir: str, tensors: dict[str, torch.Tensor], shards: int) -> list[str]:
    meta = {"format": "pt"}
    if shards == 1:
        save_file(tensors, os.path.join(fam_dir, "model.safetensors"), metadata=meta)
        os.chmod(os.path.join(fam_dir, "model.safetensors"), 0o644)
        return ["model.safetensors"]
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc = 0
    for n in names:
        k = min(shards - 1, acc * shards // total)
        groups[k].append(n)
        acc += tensors[n].numel() * tensors[n].element_size()
    if any(not g for g in groups):
        raise RuntimeError("empty shard")
    files, weight_map = [], {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, os.path.join(fam_dir, fname), metadata=meta)
        os.chmod(os.path.join(fam_dir, fname), 0o644)
        files.append(fname)
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()),
                          "total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    dump_json(os.path.join(fam_dir, "model.safetensors.index.json"), index)
    return files + ["model.safetensors.index.json"]


def load_all_safetensors(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    for fname in sorted(os.listdir(directory)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(directory, fname), "pt") as fh:
                for k in fh.keys():
                    out[k] = fh.get_tensor(k)
    return out


def v4_config(cfg: dict) -> dict:
    """The transformers-4 spelling of a transformers-5 config.json."""
    out = {}
    for key, value in cfg.items():
        if key in ("rope_parameters", "transformers_version", "_sliding_window_pattern"):
            continue
        if key == "dtype":
            out["torch_dtype"] = value
            continue
        if key == "num_local_experts" and cfg.get("model_type") == "qwen3_moe":
            out["num_experts"] = value
            continue
        if key in ("head_dim", "qk_head_dim") and cfg.get("model_type", "").startswith("deepseek"):
            continue  # derived by the config class; hub DeepSeek configs carry neither
        out[key] = value
    rp = cfg["rope_parameters"]
    if "full_attention" in rp:
        full, local = rp["full_attention"], rp["sliding_attention"]
        out["rope_theta"] = full["rope_theta"]
        out["rope_local_base_freq"] = local["rope_theta"]
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        out["rope_scaling"] = None if scaling.get("rope_type") == "default" else scaling
        types = cfg["layer_types"]
        pattern = types.index("full_attention") + 1
        expect = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                  for i in range(len(types))]
        if types != expect:
            raise RuntimeError("layer_types is not a sliding_window_pattern")
        out["sliding_window_pattern"] = pattern
        out.pop("layer_types")
    else:
        out["rope_theta"] = rp["rope_theta"]
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        if "layer_types" in out and all(t == "full_attention" for t in out["layer_types"]):
            out.pop("layer_types")
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------
# GGUF (llama.cpp convert_hf_to_gguf.py conventions, see module docstring)
# --------------------------------------------------------------------------

def llama_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(rope: dict, head_dim: int, orig_ctx: int) -> torch.Tensor:
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    low = rope.get("low_freq_factor", 1.0)
    high = rope.get("high_freq_factor", 4.0)
    low_wavelen, high_wavelen = orig_ctx / low, orig_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            s = (orig_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return torch.tensor(out, dtype=torch.float32)


def gguf_vocab(writer: gguf.GGUFWriter, fam_dir: str, hparams: dict, pre: str) -> None:
    """_set_vocab_gpt2: get_vocab_base() + SpecialVocab(load_merges=True)."""
    tokenizer = AutoTokenizer.from_pretrained(fam_dir)
    vocab_size = hparams.get("vocab_size", len(tokenizer.vocab))
    reverse = {i: t for t, i in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            looks_special = (token.startswith("<|") and token.endswith("|>") or token.startswith("<unused")
                             or token.startswith("<｜") and token.endswith("｜>"))
            types.append(gguf.TokenType.CONTROL if decoder[i].special or looks_special
                         else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(fam_dir, load_merges=True).add_to_gguf(writer, quiet=True)


def write_gguf(family: str, spec: dict, fam_dir: str, tensors: dict[str, torch.Tensor]) -> dict:
    arch = spec["gguf"]["arch"]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    hp = AutoConfig.from_pretrained(fam_dir).to_dict()
    path = os.path.join(fam_dir, "model.gguf")
    w = gguf.GGUFWriter(path, arch_name)
    notes: list[str] = []

    # ModelBase.prepare_metadata: type, name, then set_gguf_parameters
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(family)
    if arch == gguf.MODEL_ARCH.DEEPSEEK2:
        return write_gguf_deepseek2(family, spec, fam_dir, tensors, w, hp)
    n_layer = hp["num_hidden_layers"]
    w.add_block_count(n_layer)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope_all = hp.get("rope_parameters") or {}
    rope = rope_all.get("full_attention", rope_all)
    rope_type = rope.get("rope_type")
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope_type not in (None, "default", "llama3"):
        raise RuntimeError(f"unhandled rope_type {rope_type}")
    w.add_rope_freq_base(rope["rope_theta"])
    if "sliding_attention" in rope_all:
        w.add_rope_freq_base_swa(rope_all["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    n_expert = hp.get("num_local_experts", hp.get("num_experts"))
    if n_expert is not None:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == gguf.MODEL_ARCH.LLAMA:
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if arch == gguf.MODEL_ARCH.GEMMA3:
        if hp.get("attn_logit_softcapping") is not None:
            raise RuntimeError("gemma3 converter asserts attn_logit_softcapping is None")
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        if hp.get("sliding_window_pattern") != 1:
            w.add_sliding_window(hp["sliding_window"])
        notes.append("query_pre_attn_scalar (%s) is not stored; llama.cpp uses 1/sqrt(head_dim) "
                     "(1/sqrt(n_embd/n_head) for the 27B), so llama.cpp itself would not reproduce "
                     "these logits" % hp["query_pre_attn_scalar"])
        notes.append("sliding pattern not stored: llama.cpp hard-codes 6 for gemma3 (matches "
                     "layer_types here); rope.scaling (linear 8) applies to full-attention layers only")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    gguf_vocab(w, fam_dir, hp, spec["gguf"]["pre"])

    # prepare_tensors: generate_extra_tensors() first, then the checkpoint tensors
    tmap = gguf.get_tensor_name_map(arch, n_layer)
    out: list[tuple[str, np.ndarray]] = []
    if arch == gguf.MODEL_ARCH.LLAMA and rope_type == "llama3":
        head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        orig = rope["original_max_position_embeddings"]
        notes.append(f"rope_freqs computed with original_max_position_embeddings={orig} from "
                     "rope_parameters; llama.cpp's converter reads it from the top level with default 8192")
        out.append(("rope_freqs.weight", llama3_rope_factors(rope, head_dim, orig).numpy()))
    n_vocab_real = None
    if arch == gguf.MODEL_ARCH.GEMMA3:
        with open(os.path.join(fam_dir, "tokenizer.json"), encoding="utf-8") as fh:
            tj = json.load(fh)
        n_vocab_real = len(tj["model"]["vocab"]) + len(tj["added_tokens"])
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if arch == gguf.MODEL_ARCH.LLAMA:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = llama_permute(t, hp["num_attention_heads"], hp["num_attention_heads"])
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                t = llama_permute(t, hp["num_attention_heads"], hp["num_key_value_heads"])
        if arch == gguf.MODEL_ARCH.GEMMA3:
            if "embed_tokens.weight" in name:
                t = t[:n_vocab_real]
            if name.endswith("norm.weight"):
                t = t + 1
        if arch == gguf.MODEL_ARCH.QWEN3MOE and ".mlp.experts." in name:
            experts.setdefault(bid, {})[name] = t
            if len(experts[bid]) < n_expert * 3:
                continue
            for w_name in ("down_proj", "gate_proj", "up_proj"):
                stack = torch.stack([experts[bid].pop(f"model.layers.{bid}.mlp.experts.{e}.{w_name}.weight")
                                     for e in range(n_expert)], dim=0)
                merged = f"model.layers.{bid}.mlp.experts.{w_name}.weight"
                out.append((tmap.get_name(merged, try_suffixes=(".weight", ".bias")), stack.numpy()))
            continue
        new_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", name)
            if arch == gguf.MODEL_ARCH.QWEN3MOE and m:
                new_name = f"blk.{m.group(1)}.ffn_{m.group(2)}.weight"
                note = ("dense layer(s) from mlp_only_layers written as blk.N.ffn_gate/ffn_up/ffn_down: "
                        "llama.cpp's converter cannot map them for qwen3moe (it would refuse) and its "
                        "runtime expects experts in every layer")
                if note not in notes:
                    notes.append(note)
            else:
                raise RuntimeError(f"{family}: cannot map tensor {name!r}")
        out.append((new_name, t.numpy().astype(np.float32)))
    if any(experts.values()):
        raise RuntimeError("unprocessed experts")
    for name, data in out:
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32),
                     raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": "model.gguf", "arch": arch_name, "tokenizer_pre": spec["gguf"]["pre"],
            "notes": notes}


def write_gguf_deepseek2(family: str, spec: dict, fam_dir: str, tensors: dict[str, torch.Tensor],
                         w: gguf.GGUFWriter, hp: dict) -> dict:
    """DeepseekV2Model (conversion/deepseek.py) for arch deepseek2, in one of two styles:
    "mla" as the current converter writes it, "legacy" as the class wrote DeepSeek-V2 files
    before the V3 keys and the MLA-absorption split (see the module docstring)."""
    style = spec["gguf"]["style"]
    path = os.path.join(fam_dir, "model.gguf")
    notes: list[str] = []
    rope = hp["rope_parameters"]
    n_layer, n_head = hp["num_hidden_layers"], hp["num_attention_heads"]
    n_expert = hp["n_routed_experts"]
    kv_rank, nope, rot = hp["kv_lora_rank"], hp["qk_nope_head_dim"], hp["qk_rope_head_dim"]
    v_dim = hp["v_head_dim"]

    # TextModel.set_gguf_parameters (base.py); the MLA converter first sets num_key_value_heads = 1
    w.add_block_count(n_layer)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(1 if style == "mla" else hp["num_key_value_heads"])
    if rope.get("rope_type") == "yarn":
        if style == "mla":  # base.py's rope block; the legacy class wrote its own keys below
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
                if rope.get(key) is not None:
                    add(rope[key])
    elif rope.get("rope_type", "default") != "default":
        raise RuntimeError(f"unhandled rope_type {rope.get('rope_type')}")
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if style == "mla":
        w.add_expert_count(n_expert)
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if style == "mla":
        if hp.get("n_group") is not None:
            w.add_expert_group_count(hp["n_group"])
        if hp.get("topk_group") is not None:
            w.add_expert_group_used_count(hp["topk_group"])
        gating = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                  "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[hp["scoring_func"]]
        w.add_expert_gating_func(gating)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    # DeepseekV2Model.set_gguf_parameters
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(kv_rank)
    if style == "mla":
        w.add_key_length(kv_rank + rot)
        w.add_value_length(kv_rank)
        w.add_key_length_mla(nope + rot)
        w.add_value_length_mla(v_dim)
    else:
        w.add_key_length(nope + rot)
        w.add_value_length(v_dim)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_count(n_expert)
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if style == "mla" and hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rot)
    if style == "legacy" and rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if rope.get("mscale") != rope.get("mscale_all_dim"):
        raise RuntimeError("llama.cpp stores only mscale_all_dim; keep mscale == mscale_all_dim")
    notes.append("rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim; mscale itself is not stored: "
                 "llama.cpp's deepseek2 assumes mscale == mscale_all_dim (rope attention factor 1, "
                 "softmax scale mscale(factor, mscale_all_dim)**2 / sqrt(qk_nope + qk_rope)), as here")
    notes.append("topk_method is not stored; llama.cpp scores an expert group by the sum of its top-2 "
                 "selection scores (noaux_tc); a group_limited_greedy model (group max) is not representable")
    if family == "deepseek_v3":
        notes.append("rope_interleave is not stored: llama.cpp's deepseek2 always rotates adjacent pairs "
                     "(LLAMA_ROPE_TYPE_NORM), i.e. rope_interleave true, as here")
        notes.append("num_nextn_predict_layers (MTP) is not converted (skip_mtp); this HF model has no MTP "
                     "weights anyway")
    if style == "legacy":
        notes.append("legacy file: head_count_kv = num_attention_heads, key_length = qk_nope + qk_rope, "
                     "value_length = v_head_dim, whole attn_kv_b, no *_mla keys, no expert_gating_func "
                     "(llama.cpp defaults it to softmax), no expert_weights_norm (false), no yarn beta keys "
                     "(llama.cpp defaults 32 / 1, equal to this config's)")
        notes.append("no expert_group_count / expert_group_used_count: llama.cpp routes without a group "
                     "limit, so this GGUF is the HF model with n_group = topk_group = 1; reference_gguf.npz "
                     "holds those logits (reference.npz holds the HF model's)")
    if hp.get("q_lora_rank") is None:
        notes.append("no attention.q_lora_rank (the converter writes it only when set): llama.cpp's loader "
                     "(as read) requires it unless n_layer == 27 (DeepSeek-V2-Lite), so llama.cpp itself "
                     "would refuse this 3-layer file; the plain attn_q tensor is what marks no q-LoRA")

    gguf_vocab(w, fam_dir, hp, spec["gguf"]["pre"])

    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, n_layer)
    out: list[tuple[str, np.ndarray]] = []
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if ".mlp.experts." in name:
            experts.setdefault(bid, {})[name] = t
            if len(experts[bid]) < n_expert * 3:
                continue
            for w_name in ("down_proj", "gate_proj", "up_proj"):
                stack = torch.stack([experts[bid].pop(f"model.layers.{bid}.mlp.experts.{e}.{w_name}.weight")
                                     for e in range(n_expert)], dim=0)
                merged = f"model.layers.{bid}.mlp.experts.{w_name}.weight"
                out.append((tmap.get_name(merged, try_suffixes=(".weight", ".bias")), stack.numpy()))
            continue
        if name.endswith("e_score_correction_bias"):  # base.py filter_tensors
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if style == "mla" and name.endswith("kv_b_proj.weight"):
            # DeepseekV2Model.modify_tensors: per head [nope rows; v rows], k_b transposed
            kv_b = t.view(hp["num_key_value_heads"], nope + v_dim, t.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v_dim], dim=1)
            for part, data in (("k_b_proj", k_b.transpose(1, 2)), ("v_b_proj", v_b)):
                new = tmap.get_name(name.replace("kv_b_proj", part), try_suffixes=(".weight", ".bias"))
                out.append((new, data.contiguous().numpy()))
            continue
        new_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise RuntimeError(f"{family}: cannot map tensor {name!r}")
        out.append((new_name, t.numpy().astype(np.float32)))
    if any(experts.values()):
        raise RuntimeError("unprocessed experts")
    for name, data in out:
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32),
                     raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": "model.gguf", "arch": "deepseek2", "style": style,
            "tokenizer_pre": spec["gguf"]["pre"], "notes": notes}


def check_deepseek2_tensors(family: str, spec: dict, cfg, kv: dict, gt: dict, tensors: dict, expect) -> None:
    """The deepseek2 tensors and keys against the hub tensors and the config."""
    style = spec["gguf"]["style"]
    n_head, nope, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    rope = cfg.rope_parameters
    a = "deepseek2."
    want = {a + "attention.head_count": n_head,
            a + "attention.head_count_kv": 1 if style == "mla" else n_head,
            a + "attention.kv_lora_rank": cfg.kv_lora_rank,
            a + "leading_dense_block_count": cfg.first_k_dense_replace,
            a + "expert_count": cfg.n_routed_experts,
            a + "expert_used_count": cfg.num_experts_per_tok,
            a + "expert_shared_count": cfg.n_shared_experts,
            a + "expert_feed_forward_length": cfg.moe_intermediate_size,
            a + "feed_forward_length": cfg.intermediate_size,
            a + "rope.dimension_count": cfg.qk_rope_head_dim,
            a + "rope.freq_base": rope["rope_theta"],
            a + "rope.scaling.type": "yarn",
            a + "rope.scaling.factor": rope["factor"],
            a + "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            a + "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"]}
    if style == "mla":
        want.update({a + "attention.key_length": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                     a + "attention.value_length": cfg.kv_lora_rank,
                     a + "attention.key_length_mla": nope + cfg.qk_rope_head_dim,
                     a + "attention.value_length_mla": v_dim,
                     a + "expert_group_count": cfg.n_group, a + "expert_group_used_count": cfg.topk_group,
                     a + "expert_gating_func": {"sigmoid": 2, "softmax": 1}[cfg.scoring_func],
                     a + "rope.scaling.yarn_beta_fast": rope["beta_fast"],
                     a + "rope.scaling.yarn_beta_slow": rope["beta_slow"]})
        if cfg.norm_topk_prob:
            want[a + "expert_weights_norm"] = True
    else:
        want.update({a + "attention.key_length": nope + cfg.qk_rope_head_dim,
                     a + "attention.value_length": v_dim})
        for absent in ("attention.key_length_mla", "attention.value_length_mla", "expert_group_count",
                       "expert_group_used_count", "expert_gating_func", "expert_weights_norm",
                       "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow"):
            if a + absent in kv:
                raise RuntimeError(f"{family}: legacy GGUF has {a + absent}")
    if cfg.q_lora_rank is not None:
        want[a + "attention.q_lora_rank"] = cfg.q_lora_rank
    elif a + "attention.q_lora_rank" in kv:
        raise RuntimeError(f"{family}: q_lora_rank written for a model without q-LoRA")
    for key, value in want.items():
        got = kv.get(key)
        if got is None or (isinstance(value, float) and not math.isclose(got, value, rel_tol=1e-6)) or \
                (not isinstance(value, float) and got != value):
            raise RuntimeError(f"{family}: GGUF {key} = {got!r}, expected {value!r}")
    if not math.isclose(kv[a + "expert_weights_scale"], cfg.routed_scaling_factor, rel_tol=1e-6):
        raise RuntimeError(f"{family}: expert_weights_scale differs")

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        expect(b + "attn_norm.weight", tensors[p + "input_layernorm.weight"].numpy())
        expect(b + "ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"].numpy())
        if cfg.q_lora_rank is None:
            expect(b + "attn_q.weight", tensors[p + "self_attn.q_proj.weight"].numpy())
        else:
            expect(b + "attn_q_a.weight", tensors[p + "self_attn.q_a_proj.weight"].numpy())
            expect(b + "attn_q_a_norm.weight", tensors[p + "self_attn.q_a_layernorm.weight"].numpy())
            expect(b + "attn_q_b.weight", tensors[p + "self_attn.q_b_proj.weight"].numpy())
        expect(b + "attn_kv_a_mqa.weight", tensors[p + "self_attn.kv_a_proj_with_mqa.weight"].numpy())
        expect(b + "attn_kv_a_norm.weight", tensors[p + "self_attn.kv_a_layernorm.weight"].numpy())
        kv_b = tensors[p + "self_attn.kv_b_proj.weight"].numpy()
        if style == "mla":
            k_b, v_b = gt[b + "attn_k_b.weight"], gt[b + "attn_v_b.weight"]
            if k_b.shape != (n_head, cfg.kv_lora_rank, nope) or v_b.shape != (n_head, v_dim, cfg.kv_lora_rank):
                raise RuntimeError(f"{family}: attn_k_b {k_b.shape} / attn_v_b {v_b.shape}")
            # rebuild kv_b_proj from the split: per head the nope rows (k_b transposed back), then v rows
            rebuilt = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(kv_b.shape)
            if not np.array_equal(rebuilt, kv_b):
                raise RuntimeError(f"{family}: attn_k_b/attn_v_b do not rebuild kv_b_proj")
            gt.pop(b + "attn_k_b.weight")
            gt.pop(b + "attn_v_b.weight")
        else:
            expect(b + "attn_kv_b.weight", kv_b)
        expect(b + "attn_output.weight", tensors[p + "self_attn.o_proj.weight"].numpy())
        if i < cfg.first_k_dense_replace:
            for hf in ("gate", "up", "down"):
                expect(b + f"ffn_{hf}.weight", tensors[p + f"mlp.{hf}_proj.weight"].numpy())
            continue
        expect(b + "ffn_gate_inp.weight", tensors[p + "mlp.gate.weight"].numpy())
        if p + "mlp.gate.e_score_correction_bias" in tensors:
            expect(b + "exp_probs_b.bias", tensors[p + "mlp.gate.e_score_correction_bias"].numpy())
        for hf in ("gate", "up", "down"):
            expect(b + f"ffn_{hf}_exps.weight",
                   np.stack([tensors[p + f"mlp.experts.{e}.{hf}_proj.weight"].numpy()
                             for e in range(cfg.n_routed_experts)]))
            expect(b + f"ffn_{hf}_shexp.weight", tensors[p + f"mlp.shared_experts.{hf}_proj.weight"].numpy())


def reader_value(field):
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def check_gguf(family: str, spec: dict, fam_dir: str, tensors: dict[str, torch.Tensor],
               tok_json: dict) -> dict:
    reader = gguf.GGUFReader(os.path.join(fam_dir, "model.gguf"))
    kv = {name: reader_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    gt = {t.name: np.array(t.data) for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise RuntimeError(f"{t.name} is not F32")
    cfg = AutoConfig.from_pretrained(fam_dir)
    arch = kv["general.architecture"]
    if arch != gguf.MODEL_ARCH_NAMES[spec["gguf"]["arch"]]:
        raise RuntimeError(f"{family}: GGUF arch {arch}")
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    tied = cfg.tie_word_embeddings
    moe = family == "qwen3_moe"

    def expect(name, ref):
        got = gt.pop(name)
        ref = np.asarray(ref, dtype=np.float32)
        if got.shape != ref.shape or not np.array_equal(got, ref):
            raise RuntimeError(f"{family}: GGUF tensor {name} differs ({got.shape} vs {ref.shape})")

    shift = 1.0 if arch == "gemma3" else 0.0
    expect("token_embd.weight", tensors["model.embed_tokens.weight"].numpy())
    expect("output_norm.weight", tensors["model.norm.weight"].numpy() + shift)
    if not tied:
        expect("output.weight", tensors["lm_head.weight"].numpy())
    if arch == "deepseek2":
        check_deepseek2_tensors(family, spec, cfg, kv, gt, tensors, expect)
    for i in range(0 if arch == "deepseek2" else cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q = tensors[p + "self_attn.q_proj.weight"]
        k = tensors[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            # undo the permutation on the GGUF side (rows (h, pair, 2) -> (h, 2, pair))
            for gg_name, heads in ((f"blk.{i}.attn_q.weight", n_head), (f"blk.{i}.attn_k.weight", n_kv)):
                g = gt[gg_name]
                gt[gg_name] = (g.reshape(heads, g.shape[0] // heads // 2, 2, g.shape[1])
                               .swapaxes(1, 2).reshape(g.shape))
        expect(f"blk.{i}.attn_q.weight", q.numpy())
        expect(f"blk.{i}.attn_k.weight", k.numpy())
        expect(f"blk.{i}.attn_v.weight", tensors[p + "self_attn.v_proj.weight"].numpy())
        expect(f"blk.{i}.attn_output.weight", tensors[p + "self_attn.o_proj.weight"].numpy())
        for b in ("q", "k", "v"):
            if p + f"self_attn.{b}_proj.bias" in tensors:
                expect(f"blk.{i}.attn_{b}.bias", tensors[p + f"self_attn.{b}_proj.bias"].numpy())
        for hf, gg in (("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
                       ("input_layernorm", "attn_norm")):
            if p + hf + ".weight" in tensors:
                expect(f"blk.{i}.{gg}.weight", tensors[p + hf + ".weight"].numpy() + shift)
        if arch == "gemma3":
            expect(f"blk.{i}.post_attention_norm.weight",
                   tensors[p + "post_attention_layernorm.weight"].numpy() + 1)
            expect(f"blk.{i}.ffn_norm.weight", tensors[p + "pre_feedforward_layernorm.weight"].numpy() + 1)
            expect(f"blk.{i}.post_ffw_norm.weight",
                   tensors[p + "post_feedforward_layernorm.weight"].numpy() + 1)
        else:
            expect(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"].numpy())
        if moe and i not in cfg.mlp_only_layers:
            n_e = cfg.num_experts
            expect(f"blk.{i}.ffn_gate_inp.weight", tensors[p + "mlp.gate.weight"].numpy())
            for hf, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                           ("down_proj", "ffn_down_exps")):
                expect(f"blk.{i}.{gg}.weight",
                       np.stack([tensors[p + f"mlp.experts.{e}.{hf}.weight"].numpy() for e in range(n_e)]))
        else:
            for hf in ("gate", "up", "down"):
                expect(f"blk.{i}.ffn_{hf}.weight", tensors[p + f"mlp.{hf}_proj.weight"].numpy())
    if arch == "llama":
        rope = cfg.rope_parameters
        head_dim = cfg.head_dim
        ref = llama3_rope_factors(rope, head_dim, rope["original_max_position_embeddings"]).numpy()
        expect("rope_freqs.weight", ref)
    if gt:
        raise RuntimeError(f"{family}: unexpected GGUF tensors {sorted(gt)}")

    # tokenizer keys
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok_json["model"]["merges"]]
    if kv["tokenizer.ggml.merges"] != merges:
        raise RuntimeError("GGUF merges differ from tokenizer.json")
    toks = kv["tokenizer.ggml.tokens"]
    if len(toks) != cfg.vocab_size:
        raise RuntimeError("GGUF token list length != vocab_size")
    for t, i in tok_json["model"]["vocab"].items():
        if toks[i] != t:
            raise RuntimeError(f"GGUF token {i} is {toks[i]!r}, tokenizer.json has {t!r}")
    for a in tok_json["added_tokens"]:
        if toks[a["id"]] != a["content"]:
            raise RuntimeError("GGUF added token mismatch")
    if kv["tokenizer.chat_template"] != spec["template"]:
        raise RuntimeError("GGUF chat template differs")
    required = [f"{arch}.{k}" for k in ("block_count", "context_length", "embedding_length",
                                        "feed_forward_length", "attention.head_count",
                                        "attention.head_count_kv", "rope.freq_base",
                                        "attention.layer_norm_rms_epsilon")]
    required += ["general.architecture", "general.file_type", "tokenizer.ggml.model",
                 "tokenizer.ggml.pre", "tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id"]
    missing = [k for k in required if k not in kv]
    if missing:
        raise RuntimeError(f"GGUF misses keys {missing}")
    summary = {k: v for k, v in kv.items()
               if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                            "tokenizer.ggml.merges", "tokenizer.chat_template")}
    summary["tokenizer.ggml.tokens"] = f"<{len(toks)} strings>"
    summary["tokenizer.ggml.merges"] = f"<{len(merges)} strings>"
    summary["tokenizer.ggml.token_type"] = {str(v): kv["tokenizer.ggml.token_type"].count(v)
                                            for v in sorted(set(kv["tokenizer.ggml.token_type"]))}
    summary["tokenizer.chat_template"] = "<same as tokenizer_config.json>"
    shapes = {t.name: [int(x) for x in np.array(t.data).shape] for t in reader.tensors}
    return {"metadata": summary, "tensor_numpy_shapes": shapes}


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

@torch.no_grad()
def variant_logits(model, change: dict, results) -> list[np.ndarray]:
    """Cache-free logits over each prompt + greedy path of a copy of ``model`` with ``change``
    (config keys; "_state": {name suffix: fill value} for tensors of the state_dict)."""
    change = dict(change)
    fills = change.pop("_state", {})
    cfg = copy.deepcopy(model.config)
    for key, value in change.items():
        setattr(cfg, key, copy.deepcopy(value))
    other = type(model)(cfg).to(torch.float32)
    state = model.state_dict()
    for suffix, value in fills.items():
        hit = [k for k in state if k.endswith(suffix)]
        if not hit:
            raise RuntimeError(f"ablation: no tensor ends with {suffix!r}")
        for k in hit:
            state[k] = torch.full_like(state[k], value)
    other.load_state_dict(state)
    other.eval()
    return [forward_logits(other, r["ids"] + r["greedy"]) for r in results]


@torch.no_grad()
def ablation_diffs(family: str, model, results) -> dict:
    out = {}
    for label, change in ABLATIONS[family].items():
        diffs, flips = [], 0
        for r, logits in zip(results, variant_logits(model, change, results)):
            diffs.append(float(np.abs(logits - r["logits"]).max()))
            n = len(r["ids"])
            flips += int((logits[n - 1:n - 1 + NEW_TOKENS].argmax(-1) != np.asarray(r["greedy"])).sum())
        if max(diffs) < 1e-2:
            raise RuntimeError(f"{family}: ablation {label!r} barely changes the logits ({diffs})")
        out[label] = {"max_abs_logit_diff": diffs, "greedy_argmax_changes": flips}
    return out


def chat_examples(family: str, tokenizer) -> list[dict]:
    out = []
    for case in CHAT_CASES + FAMILY_CHAT_CASES.get(family, []):
        kwargs = dict(case.get("kwargs", {}))
        if family == "llama3":
            kwargs["date_string"] = LLAMA3_DATE
        entry = {"name": case["name"], "messages": case["messages"],
                 "add_generation_prompt": case["add_generation_prompt"], "kwargs": kwargs}
        try:
            text = tokenizer.apply_chat_template(case["messages"], tokenize=False,
                                                 add_generation_prompt=case["add_generation_prompt"],
                                                 **kwargs)
        except Exception as exc:  # recorded; the engine must raise too
            entry["error"] = f"{type(exc).__name__}: {exc}"
        else:
            entry["rendered"] = text
            entry["ids"] = [int(t) for t in tokenizer(text, add_special_tokens=False).input_ids]
        out.append(entry)
    if family == "gemma3" and "error" not in out[-1]:
        raise RuntimeError("gemma3 template did not raise on non-alternating roles")
    return out


def build_family(family: str, spec: dict, base_json: str) -> dict:
    fam_dir = os.path.join(OUT_ROOT, family)
    if os.path.isdir(fam_dir):
        shutil.rmtree(fam_dir)
    os.makedirs(fam_dir)
    print(f"[{family}]", flush=True)

    # tokenizer
    tok = family_tokenizer(base_json, family, spec)
    tok.save(os.path.join(fam_dir, "tokenizer.json"))
    dump_json(os.path.join(fam_dir, "tokenizer_config.json"), tokenizer_config(family, spec, tok))
    hf_tok = AutoTokenizer.from_pretrained(fam_dir)
    tok_examples = []
    for s in TOKENIZER_STRINGS:
        ids = hf_tok(s).input_ids
        if ids != tok.encode(s).ids:
            raise RuntimeError(f"{family}: AutoTokenizer and tokenizers disagree on {s!r}")
        tok_examples.append({"text": s, "ids_with_special_tokens": ids,
                             "tokens": hf_tok.convert_ids_to_tokens(ids),
                             "decoded": hf_tok.decode(ids, skip_special_tokens=False)})

    # prompts (fixed per family) and weight seed search
    rng = np.random.default_rng(spec["prompt_seed"])
    prompts = [[int(x) for x in rng.integers(0, BASE_VOCAB, size=n)] for n in PROMPT_LENS]
    torch.set_num_threads(2)
    for attempt in range(MAX_SEED_ATTEMPTS):
        seed = spec["base_seed"] + attempt
        model = build_model(spec, tok, seed)
        results = greedy_reference(model, prompts)
        gap = min(r["min_gap"] for r in results)
        distinct = [len(set(r["greedy"])) for r in results]
        print(f"  seed {seed}: min top-2 gap {gap:.5f}, distinct greedy tokens {distinct}", flush=True)
        if gap >= MIN_GAP and min(distinct) >= MIN_DISTINCT_GREEDY:
            break
    else:
        raise RuntimeError(f"{family}: no seed gave a gap >= {MIN_GAP} and a diverse greedy path")

    # config.json / generation_config.json exactly as save_pretrained writes them
    tensors = hub_tensors(family, model)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for fname in ("config.json", "generation_config.json"):
            shutil.copy(os.path.join(tmp, fname), os.path.join(fam_dir, fname))
        theirs = load_all_safetensors(tmp)
    if model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    if sorted(theirs) != sorted(tensors) or any(not torch.equal(theirs[k], tensors[k]) for k in tensors):
        raise RuntimeError(f"{family}: hub tensors differ from save_pretrained's")
    weight_files = write_safetensors(fam_dir, tensors, spec["shards"])
    with open(os.path.join(fam_dir, "config.json"), encoding="utf-8") as fh:
        cfg_json = json.load(fh)
    dump_json(os.path.join(fam_dir, "config_v4.json"), v4_config(cfg_json))

    # reload checks: written dir, and the same weights with config_v4.json
    def reload_diffs(directory):
        m = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 attn_implementation="eager")
        m.eval()
        return [float(np.abs(forward_logits(m, r["ids"] + r["greedy"]) - r["logits"]).max())
                for r in results]

    reload_diff = reload_diffs(fam_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for fname in weight_files:
            shutil.copy(os.path.join(fam_dir, fname), os.path.join(tmp, fname))
        shutil.copy(os.path.join(fam_dir, "config_v4.json"), os.path.join(tmp, "config.json"))
        v4_cfg = AutoConfig.from_pretrained(tmp)
        v5_cfg = AutoConfig.from_pretrained(fam_dir)
        for key in ("rope_parameters", "layer_types", "sliding_window", "num_experts",
                    "num_local_experts", "head_dim"):
            if getattr(v4_cfg, key, None) != getattr(v5_cfg, key, None):
                raise RuntimeError(f"{family}: config_v4 {key} = {getattr(v4_cfg, key, None)} "
                                   f"!= {getattr(v5_cfg, key, None)}")
        v4_diff = reload_diffs(tmp)
    if max(reload_diff + v4_diff) != 0.0:
        raise RuntimeError(f"{family}: reloaded logits differ {reload_diff} {v4_diff}")

    # reference arrays
    arrays = {}
    for k, r in enumerate(results):
        arrays[f"ids_{k}"] = np.asarray(r["ids"], dtype=np.int32)
        arrays[f"greedy_{k}"] = np.asarray(r["greedy"], dtype=np.int32)
        arrays[f"logits_{k}"] = r["logits"].astype(np.float32)
        assert arrays[f"logits_{k}"].shape == (len(r["ids"]) + NEW_TOKENS, VOCAB_SIZE)
    np.savez(os.path.join(fam_dir, "reference.npz"), **arrays)

    # GGUF
    gguf_info = None
    if spec["gguf"] is not None:
        gguf_info = write_gguf(family, spec, fam_dir, tensors)
        with open(os.path.join(fam_dir, "tokenizer.json"), encoding="utf-8") as fh:
            tok_json = json.load(fh)
        gguf_info.update(check_gguf(family, spec, fam_dir, tensors, tok_json))
        if spec["gguf"].get("same_as") is not None:
            # the GGUF is (as llama.cpp reads it) a variant of the HF model: record its logits
            change = spec["gguf"]["same_as"]
            gguf_logits = variant_logits(model, change, results)
            np.savez(os.path.join(fam_dir, "reference_gguf.npz"),
                     **{f"logits_{k}": x.astype(np.float32) for k, x in enumerate(gguf_logits)})
            gguf_info["reference_logits"] = {
                "file": "reference_gguf.npz",
                "hf_change": change,
                "what": ("logits_K: the HF model with hf_change applied, over the same ids_K + greedy_K "
                         "as reference.npz; this is the model the GGUF describes for llama.cpp"),
                "max_abs_diff_from_reference": [float(np.abs(x - r["logits"]).max())
                                                for x, r in zip(gguf_logits, results)]}
    else:
        gguf_info = {"skipped": spec["gguf_skip"]}

    specials = {content: tok.token_to_id(content) for content, _ in SPECIALS[family]}
    files = sorted(f for f in os.listdir(fam_dir))
    ref = {
        "description": ("Reference outputs of Hugging Face transformers (PyTorch, CPU, float32, eager "
                        "attention) for a tiny random-weight %s model. Generated by "
                        "scripts/make_family_fixtures.py; see its docstring." % family),
        "family": family,
        "model_class": type(model).__name__,
        "model_type": model.config.model_type,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": pkg_version("tokenizers"),
            "gguf": pkg_version("gguf"),
            "safetensors": pkg_version("safetensors"),
            "numpy": np.__version__,
            "jinja2": pkg_version("jinja2"),
        },
        "seeds": {"weights": seed, "base_weight_seed": spec["base_seed"], "attempts": attempt + 1,
                  "prompts": spec["prompt_seed"], "torch_threads": 2},
        "init": {"embed_and_lm_head_std": spec.get("std_embed", STD_EMBED), "matrix_std": STD_MATRIX,
                 "norm": ("0.2*N(0,1) (zero-centred, RMSNorm uses 1+w)" if spec["zero_centred_norm"]
                          else "1 + 0.2*N(0,1)"), "bias_std": STD_BIAS},
        "shapes": {k: list(v.shape) for k, v in arrays.items()},
        "new_tokens": NEW_TOKENS,
        "min_top2_gap": min(r["min_gap"] for r in results),
        "min_top2_gap_per_prompt": [r["min_gap"] for r in results],
        "distinct_greedy_tokens": [len(set(r["greedy"])) for r in results],
        "generate_vs_forward_max_abs_diff": [r["cache_vs_forward"] for r in results],
        "from_pretrained_max_abs_diff": reload_diff,
        "config_v4_from_pretrained_max_abs_diff": v4_diff,
        "max_abs_logit": [float(np.abs(r["logits"]).max()) for r in results],
        "ablations": ablation_diffs(family, model, results),
        "sliding_window_semantics": ("transformers masks key j for query i unless i - W < j <= i "
                                     "(each query sees at most W keys, itself included)"),
        "special_tokens": specials,
        "tokenizer": {"bos_token": spec["tok"]["bos"], "eos_token": spec["tok"]["eos"],
                      "pad_token": spec["tok"]["pad"], "add_bos_token": spec["tok"]["add_bos"],
                      "pre_tokenizer": spec["tok"]["pretok"], "base_vocab": BASE_VOCAB,
                      "examples": tok_examples},
        "generation_config_eos_token_id": model.generation_config.eos_token_id,
        "chat_examples": chat_examples(family, hf_tok),
        "weights": {"files": weight_files, "sharded": spec["shards"] > 1,
                    "tensor_names": list(tensors),
                    "shapes": {k: list(v.shape) for k, v in tensors.items()}},
        "gguf": gguf_info,
    }
    ref["files"] = {f: sha256_of(os.path.join(fam_dir, f)) for f in files}
    dump_json(os.path.join(fam_dir, "reference.json"), ref)
    print(f"  ok: gap {ref['min_top2_gap']:.5f}, files {files}", flush=True)
    return ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(FAMILIES), action="append")
    args = parser.parse_args()
    torch.set_num_threads(2)
    os.makedirs(OUT_ROOT, exist_ok=True)
    with open(os.path.join(OUT_ROOT, ".gitignore"), "w", encoding="utf-8") as fh:
        fh.write("# written by scripts/make_family_fixtures.py: these fixtures are committed\n"
                 "!*.gguf\n!*.safetensors\n")
    base_json = train_base_bpe()
    if train_base_bpe() != base_json:
        raise RuntimeError("BPE training is not deterministic")
    for family in args.only or list(FAMILIES):
        build_family(family, FAMILIES[family], base_json)


if __name__ == "__main__":
    main()
