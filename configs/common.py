"""The schema every family config shares: model fields, plus the data, training,
checkpoint, mesh and sharding sections. Family files override values only.
"""

import ml_collections

from . import data_defaults, sharding_rules, train_defaults


def model_config() -> ml_collections.ConfigDict:
  """The `config.model` section: exactly the fields of tx_jax.models.ModelConfig."""
  m = ml_collections.ConfigDict()
  m.family = "decoder"  # "decoder" (GPT/LLaMA), "encoder" (BERT) or "encdec" (Transformer/T5)
  m.vocab_size = 260  # token ids [0, vocab_size); 260 = byte tokenizer with its special ids
  m.d_model = 64  # model width D
  m.num_layers = 2  # layers (the encoder's, for encdec)
  m.num_decoder_layers = 0  # decoder layers (encdec only)
  m.num_heads = 4  # query heads N
  m.num_kv_heads = 4  # key/value heads K (< num_heads: grouped-query attention; 1: MQA)
  m.head_dim = 16  # per-head width H (T5 decouples it from d_model / num_heads)
  m.mlp_dim = 256  # MLP hidden width F
  m.mlp_activation = "gelu"  # "relu", "gelu" (exact erf), "gelu_tanh" or "silu"
  m.gated_mlp = False  # GLU-style MLP: act(x W0) * (x W1) (GeGLU / SwiGLU)
  m.norm = "layernorm"  # "layernorm" or "rmsnorm"
  m.norm_eps = 1e-5  # epsilon inside the norms
  m.norm_bias = True  # LayerNorm with a bias (T5's and LLaMA's norms have none)
  m.pre_norm = True  # pre-norm residuals (GPT-2, T5, LLaMA) vs post-norm (paper, BERT)
  m.embed_norm = False  # LayerNorm right after the embeddings (BERT)
  m.positions = "learned"  # "learned", "sinusoidal", "rope", "relative" (T5), "alibi", "none"
  m.max_len = 512  # rows of the learned position table; longest sequence for "learned"
  m.rope_theta = 10000.0  # RoPE base wavelength
  m.relative_buckets = 32  # T5 relative-position buckets
  m.relative_max_distance = 128  # T5 distance beyond which buckets stop growing
  m.embed_scale = False  # multiply token embeddings by sqrt(d_model) (the paper)
  m.tie_embeddings = True  # output projection = token embedding transposed
  m.tied_output_rescale = False  # scale decoder output by d_model^-0.5 before tied logits (T5 v1.0)
  m.attention_bias = True  # biases on the q/k/v/out projections
  m.mlp_bias = True  # biases on the MLP projections
  m.scale_attention = True  # divide logits by sqrt(head_dim); False for T5 (folded into init)
  m.dropout_rate = 0.0  # dropout on embeddings and residual branches
  m.attention_dropout_rate = 0.0  # dropout on attention weights
  m.mlp_inner_dropout_rate = 0.0  # dropout after the MLP activation (T5)
  m.type_vocab_size = 0  # token-type (segment A/B) embeddings; 0 = none (BERT: 2)
  m.pooler = False  # tanh dense pooler over the first token (BERT)
  m.head = "none"  # encoder head: "none", "mlm" or "classification"
  m.num_classes = 2  # classes of the classification head
  m.init = "normal"  # kernel init: "normal" (std init_std) or "xavier_uniform" (the paper)
  m.init_std = 0.02  # standard deviation of "normal" init
  m.dtype = "float32"  # compute dtype: "float32" or "bfloat16" (softmax/logits/loss stay f32)
  m.param_dtype = "float32"  # parameter storage dtype
  # "dense" (XLA einsums, full [T, S]), "blockwise" (online softmax over key blocks, any
  # device), "cudnn" (jax.nn fused kernel, NVIDIA GPU, bf16/fp16, unpacked rows), "pallas"
  # (JAX's Pallas flash kernel, GPU; self-attention without bias or window), "splash" (JAX's
  # Pallas splash kernel, TPU; no bias)
  m.attention_backend = "dense"
  m.blockwise_block_q = 512  # query block of the "blockwise" backend
  m.blockwise_block_k = 512  # key block of the "blockwise" backend
  # Rows may hold several segments, or padding before the end; base_config ties it to
  # data.pack. False lets "cudnn" take sequence lengths instead of a [T, S] mask
  m.packed_inputs = True
  # Kernels behind the layers' one seam (tx_jax/layers/ops.py): "plain" (JAX ops under
  # autodiff, every platform) or "cpu" (opt-in XLA:CPU tuning, tx_jax/cpu: MKL with the
  # cpu-mkl extra, custom VJPs, chunked causal `dense`). "cpu" is reverse-mode only: its
  # custom VJPs make jax.jvp / jax.linearize fail
  m.kernels = "plain"
  # Self-attention when config.mesh.sequence > 1: "ring" (key/value blocks pass around the
  # devices; memory per device falls as 1/sequence) or "all_gather" (every device gathers all
  # keys and values: the simple baseline)
  m.context_parallel = "ring"
  # Causal load balance on a sequence mesh: "data" (the trainer hands causal rows over in
  # zig-zag order with their natural indices, tx_jax/data/context_order.py), "attention"
  # (attention reorders q, k, v itself: any caller, but each layer keeps reordered copies)
  # or "none" (natural order: the last device does most of the work)
  m.context_load_balance = "data"
  # Self-attention's projections stacked: q, k, v as one [D, 3, N, H] kernel "qkv" (GPT-2
  # stores its c_attn this way too), or with fewer kv heads q alone and k, v as one
  # [D, 2, K, H] "kv". Fewer, wider GEMMs; HF import/export map both layouts
  m.fused_qkv = False
  m.scan_layers = False  # nn.scan over layers: one compiled layer, params stacked
  m.remat_policy = "none"  # rematerialisation: "none", "full", "dots", "dots_no_batch"
  m.lora = lora_config()
  return m


def lora_config() -> ml_collections.ConfigDict:
  """`config.model.lora`: low-rank adapters (tx_jax/layers/lora.py); rank 0 = off."""
  c = ml_collections.ConfigDict()
  c.rank = 0  # adapter rank r; 0 = no LoRA (every param trains)
  c.alpha = 16.0  # the adapter's output is scaled by alpha / rank (PEFT's lora_alpha)
  c.dropout = 0.0  # dropout on the adapter's input, in training only (PEFT's lora_dropout)
  # Projections to adapt: "query", "key", "value", "output", "qkv" (fused_qkv's stacked
  # kernels), "mlp_up", "mlp_gate", "mlp_down", "lm_head" (untied), or regexes on module
  # paths such as "layer_0/self_attention/query"
  c.targets = ("query", "value")
  # With LoRA on, only the adapters train; these regexes on param paths train in full too
  # (e.g. "norm", "classifier")
  c.also_train = ()
  return c


def base_config() -> ml_collections.ConfigDict:
  """Every section with its defaults; a family file overrides what its paper sets."""
  config = ml_collections.ConfigDict()
  config.seed = 0  # seeds parameter init, dropout and anything else random in training
  # The HuggingFace directory experiments.convert --from_hf read ("" for a model initialised
  # here); --to_peft writes it as the adapter's base_model_name_or_path
  config.converted_from = ""
  config.model = model_config()
  config.data = data_defaults.data_config()
  # One fact: what the data pipeline packs is what the attention backends are told.
  config.model.packed_inputs = config.data.get_ref("pack")
  config.train = train_defaults.train_config()
  config.optimizer = train_defaults.optimizer_config()
  config.schedule = train_defaults.schedule_config()
  config.loss = train_defaults.loss_config()
  config.checkpoint = train_defaults.checkpoint_config()
  config.mesh = sharding_rules.mesh_config()
  config.sharding = sharding_rules.sharding_config()
  return config


def get_preset(presets: dict, arg: str | None, default: str, family_file: str):
  """Looks up a named preset function, with an error listing the accepted names."""
  name = arg or default
  if name not in presets:
    raise ValueError(
        f"unknown preset {name!r} for configs/{family_file}; " f"accepted: {sorted(presets)}"
    )
  return presets[name]
