r"""Train a SentencePiece vocabulary on the configured data set's training split.

  python -m experiments.train_tokenizer --config=configs/gpt.py:tiny \
      --config.data.source=tfds --config.data.tfds_name=tiny_shakespeare \
      --config.data.vocab_size=2000 --model_prefix=/tmp/shakespeare_spm

Writes <model_prefix>.model / .vocab (default: config.data.spm_model_path without
".model"); load it with --config.data.tokenizer=sentencepiece
--config.data.spm_model_path=<model_prefix>.model.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from tx_jax import cli

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    default="configs/transformer.py",
    help_string="Config file[:preset].",
    lock_config=True,
)
_PREFIX = flags.DEFINE_string(
    "model_prefix", None, "Output path without extension (default: data.spm_model_path)."
)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from tx_jax.data import sources, tokenizers  # pylint: disable=g-import-not-at-top

  data_cfg = _CONFIG.value.data
  prefix = _PREFIX.value or data_cfg.spm_model_path.removesuffix(".model")
  if not prefix:
    raise app.UsageError("give --model_prefix or --config.data.spm_model_path")
  if data_cfg.vocab_size <= 5:
    raise app.UsageError(
        f"--config.data.vocab_size={data_cfg.vocab_size}: must exceed the 5 special pieces"
    )
  from tx_jax import data  # pylint: disable=g-import-not-at-top

  data.validate(data_cfg)
  path = tokenizers.train_sentencepiece(
      sources.texts(data_cfg, data_cfg.train_split),
      prefix,
      vocab_size=data_cfg.vocab_size,
      model_type=data_cfg.spm_model_type,
  )
  print(f"wrote {path}")


if __name__ == "__main__":
  cli.run(main)
