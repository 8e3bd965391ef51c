r"""Train a tokenizer on the configured data set's training split.

  python -m experiments.train_tokenizer --config=configs/gpt.py:tiny \
      --config.data.source=tfds --config.data.tfds_name=tiny_shakespeare \
      --config.data.vocab_size=2000 --model_prefix=/tmp/shakespeare_spm

SentencePiece (any data.tokenizer but hf): writes <model_prefix>.model /
.vocab (default: config.data.spm_model_path without ".model"); load it with
--config.data.tokenizer=sentencepiece --config.data.spm_model_path=<model_prefix>.model.

HF tokenizers (--config.data.tokenizer=hf): trains --config.data.hf_model_type (byte_bpe like
GPT-2, bpe like LLaMA-2, unigram like T5, wordpiece like BERT) and writes a tokenizer.json at
--output (a .json file or a directory; default: config.data.tokenizer_path); load it with
--config.data.tokenizer=hf --config.data.tokenizer_path=<that path>.
"""

from absl import app
from absl import flags

from tx_jax import cli

_CONFIG = cli.define_config_file(
    name="config",
    default="configs/transformer.py",
    help_string="Config file[:preset].",
    lock_config=True,
)
_PREFIX = flags.DEFINE_string(
    "model_prefix",
    None,
    "SentencePiece output path without extension (default: data.spm_model_path).",
)
_OUTPUT = flags.DEFINE_string(
    "output", None, "HF tokenizer.json file or directory (default: data.tokenizer_path)."
)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from tx_jax.data import hf_tokenizer, sources, tokenizers  # pylint: disable=g-import-not-at-top

  data_cfg = _CONFIG.value.data
  from tx_jax import data  # pylint: disable=g-import-not-at-top

  data.validate(data_cfg)
  if data_cfg.vocab_size <= 5:
    raise app.UsageError(
        f"--config.data.vocab_size={data_cfg.vocab_size}: must exceed the 5 special pieces"
    )
  texts = sources.texts(data_cfg, data_cfg.train_split)
  if data_cfg.tokenizer == "hf":
    output = _OUTPUT.value or data_cfg.tokenizer_path
    if not output:
      raise app.UsageError("give --output or --config.data.tokenizer_path")
    path = hf_tokenizer.train_hf_tokenizer(
        texts,
        output,
        kind=data_cfg.hf_model_type,
        vocab_size=data_cfg.vocab_size,
        num_sentinels=data_cfg.num_sentinels if data_cfg.hf_model_type == "unigram" else 0,
    )
  else:  # SentencePiece, whatever tokenizer the config uses now (it is what gets trained)
    prefix = _PREFIX.value or data_cfg.spm_model_path.removesuffix(".model")
    if not prefix:
      raise app.UsageError("give --model_prefix or --config.data.spm_model_path")
    path = tokenizers.train_sentencepiece(
        texts, prefix, vocab_size=data_cfg.vocab_size, model_type=data_cfg.spm_model_type
    )
  print(f"wrote {path}")


if __name__ == "__main__":
  cli.run(main)
