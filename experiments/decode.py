r"""Decode from a trained workdir or a HuggingFace model directory.

  python -m experiments.decode --workdir runs/default --prompt "hello"            # sample
  python -m experiments.decode --workdir runs/mt --input_file de.txt --output_file en.txt
  python -m experiments.decode --workdir gpt2_dir --prompt_ids 464,2068 --strategy greedy --json

--strategy defaults to "sample" for --prompt / --prompt_ids and "beam" for --input_file.
With --json every output is one JSON line: input, tokens (generated ids), text.
Compiled programs are kept in JAX's persistent cache (--compilation_cache_dir, as in
experiments.train), so a second decode of the same model skips its compiles.
"""

import json

from absl import app, flags, logging

from tx_jax import cli

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Trainer workdir or HF model directory.", required=True
)
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue (or translate, for encdec).")
_PROMPT_IDS = flags.DEFINE_string("prompt_ids", None, "Comma-separated token ids, e.g. 1,2,3.")
_INPUT_FILE = flags.DEFINE_string("input_file", None, "One input text per line.")
_OUTPUT_FILE = flags.DEFINE_string("output_file", None, "Outputs, one line per input line.")
_STRATEGY = flags.DEFINE_enum("strategy", None, ["greedy", "sample", "beam"], "How to decode.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per input.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0 = all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].")
_BEAM_SIZE = flags.DEFINE_integer("beam_size", 4, "Beam width.")
_ALPHA = flags.DEFINE_float("alpha", 0.6, "GNMT length penalty exponent.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line per output.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Inputs decoded together.")
_COMPILATION_CACHE_DIR = cli.define_compilation_cache_dir()


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  sources = [f for f in ("prompt", "prompt_ids", "input_file") if flags.FLAGS[f].value is not None]
  if len(sources) != 1:
    raise app.UsageError(
        f"give exactly one of --prompt, --prompt_ids, --input_file " f"(got {sources or 'none'})"
    )
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.ERROR)  # Orbax warns about read-only checkpoint dirs
  import jax  # pylint: disable=g-import-not-at-top
  from tx_jax import compile_cache  # pylint: disable=g-import-not-at-top
  from tx_jax import decode, validation, workdir  # pylint: disable=g-import-not-at-top
  from tx_jax.decode import workdir as wd  # pylint: disable=g-import-not-at-top

  strategy_name = _STRATEGY.value or ("beam" if _INPUT_FILE.value else "sample")
  validation.decode_flags(
      strategy=strategy_name,
      max_new_tokens=_MAX_NEW_TOKENS.value,
      temperature=_TEMPERATURE.value,
      top_k=_TOP_K.value,
      top_p=_TOP_P.value,
      beam_size=_BEAM_SIZE.value,
      alpha=_ALPHA.value,
      batch_size=_BATCH_SIZE.value,
      input_file=_INPUT_FILE.value,
  )
  strategy = decode.Strategy(
      strategy_name,
      max_new_tokens=_MAX_NEW_TOKENS.value,
      temperature=_TEMPERATURE.value,
      top_k=_TOP_K.value,
      top_p=_TOP_P.value,
      beam_size=_BEAM_SIZE.value,
      alpha=_ALPHA.value,
  ).validate()
  compile_cache.enable(_COMPILATION_CACHE_DIR.value)  # before the first compile
  config, module, params, _ = wd.load(_WORKDIR.value)
  tokenizer = workdir.build_tokenizer(config)  # None: the model came without one (ids only)
  special = workdir.special_ids(config, tokenizer)  # config.data's (converted HF), else its own
  eos_id, start_id = special.eos, special.decoder_start
  if _PROMPT_IDS.value is not None:
    texts, inputs = None, [validation.prompt_ids(_PROMPT_IDS.value, module.config.vocab_size)]
  else:
    if tokenizer is None:
      raise app.UsageError(
          f"{_WORKDIR.value} has no tokenizer tx_jax can load; pass --prompt_ids instead of text"
      )
    if _PROMPT.value is not None:
      texts = [validation.prompt_text(_PROMPT.value)]
    else:
      with open(_INPUT_FILE.value, encoding="utf-8") as f:
        texts = [line.rstrip("\n") for line in f]
      validation.texts_not_empty(texts, f"--input_file={_INPUT_FILE.value}")
    inputs = decode.encode_sources(
        tokenizer, texts, append_eos=module.config.family == "encdec"
    )
  outputs = decode.decode_batches(  # a ValueError (an input too long, ...) exits 2 via cli.run
      module,
      params,
      inputs,
      strategy,
      eos_id=eos_id,
      decoder_start_id=start_id,
      rng=jax.random.key(_SEED.value),
      batch_size=_BATCH_SIZE.value,
  )
  lines = []
  for i, ids in enumerate(outputs):
    record = {"input": texts[i] if texts else inputs[i], "tokens": ids}
    if tokenizer is not None:
      record["text"] = tokenizer.decode(ids)
    lines.append(record.get("text", " ".join(map(str, ids))))
    print(json.dumps(record, ensure_ascii=False) if _JSON.value else lines[-1], flush=True)
  if _OUTPUT_FILE.value:
    with open(_OUTPUT_FILE.value, "w", encoding="utf-8") as f:
      # One line per input: line breaks inside an output become spaces.
      f.writelines(line.replace("\r", " ").replace("\n", " ") + "\n" for line in lines)
  return 0


if __name__ == "__main__":
  cli.run(main)
