"""The `config.data` section: defaults need nothing downloaded (synthetic reversal)."""

import ml_collections


def data_config() -> ml_collections.ConfigDict:
  """Input pipeline defaults; family configs override fields."""
  c = ml_collections.ConfigDict()
  # --- where examples come from ---
  c.source = "synthetic"  # synthetic | tfds | multi30k | text_files | tsv
  c.task = "seq2seq"  # lm | mlm | span_corruption | seq2seq | classification
  c.train_split = "train"  # training split (eval split: config.train.eval_split); multi30k
  # splits: train | validation | test2016; synthetic: train | validation | test
  # --- TFDS (source="tfds"; data_dir / manual_dir also serve source="multi30k") ---
  c.tfds_name = ""  # any TFDS name, e.g. "tiny_shakespeare", "glue/sst2"
  c.tfds_data_dir = ml_collections.config_dict.placeholder(str)  # None: TFDS's default dir
  c.manual_dir = ml_collections.config_dict.placeholder(str)  # raw files for offline preparation
  # --- feature keys (TFDS features, or TSV header columns) ---
  c.text_key = "text"  # text feature for lm / mlm / span_corruption / classification
  c.text_pair_key = ""  # second sentence for pair classification ("" = single sentence)
  c.label_key = "label"  # integer class feature for classification
  c.source_key = "de"  # seq2seq source text feature
  c.target_key = "en"  # seq2seq target text feature
  # --- local files (source="text_files" | "tsv"); comma-separated globs ---
  c.train_files = ""  # files read for train_split
  c.eval_files = ""  # files read for any other split
  c.text_files_document = "line"  # text_files unit of one example: "line" | "file"
  # --- tokenizer ---
  # byte | sentencepiece | hf (a tokenizers tokenizer.json) | none (a converted model that came
  # without a tokenizer: ids only)
  c.tokenizer = "byte"
  c.spm_model_path = ""  # SentencePiece .model to load (T5's works); written by train_tokenizer
  # hf: a tokenizer.json, or a directory holding one (an HF model directory or a converted
  # workdir); its tokenizer_config.json / special_tokens_map.json name the special tokens
  c.tokenizer_path = ""
  c.vocab_size = 8000  # pieces when experiments.train_tokenizer trains a tokenizer
  c.spm_model_type = "unigram"  # SentencePiece training algorithm: unigram | bpe
  # what train_tokenizer trains for tokenizer=hf: byte_bpe (GPT-2) | bpe | unigram | wordpiece
  c.hf_model_type = "byte_bpe"
  # Special ids; None = the tokenizer's own. experiments.convert records an HF model's here, so
  # decoding and fine-tuning use the ids the model was trained with. Batches always pad with 0
  # (segment id 0); pad_id is the id HF names padding, written back by convert --to_hf.
  c.bos_id = ml_collections.config_dict.placeholder(int)
  c.eos_id = ml_collections.config_dict.placeholder(int)
  c.pad_id = ml_collections.config_dict.placeholder(int)
  c.decoder_start_id = ml_collections.config_dict.placeholder(int)  # seq2seq first decoder input
  c.num_sentinels = 100  # T5 extra ids on top of the vocabulary (sentinel 0 = last id)
  # --- lengths and batching ---
  c.seq_len = 128  # LM / encoder-only length T
  c.source_len = 16  # seq2seq encoder length S (span corruption: corrupted-input length)
  c.target_len = 16  # seq2seq decoder length T
  # Pack several examples per row (lm, mlm, span_corruption, seq2seq). Off by default: the
  # synthetic strings (<= 12 + eos) fill 16-token rows, and unpacked input is ~4x faster.
  c.pack = False
  c.global_batch_size = 64  # training rows per step, over all processes
  c.num_shards = (
      -1
  )  # input streams of the global batch; -1 = one per process; fixed: same batches on any host count
  c.eval_global_batch_size = 64  # eval rows per step, over all processes
  c.shuffle_seed = 0  # order, packing and masking are pure functions of this seed
  c.num_epochs = ml_collections.config_dict.placeholder(int)  # None: repeat forever
  # lm / mlm / span chunks are shuffled within windows of this many rows (data/window_shuffle.py:
  # one numpy permutation per window, which is held in memory). Rows of one window come from
  # consecutive text: a corpus that fits should get a window that covers it.
  c.lm_shuffle_window = 1024
  c.worker_count = 0  # grain worker processes (0: in-process; > 0 needs absl flags parsed)
  c.read_threads = 0  # grain threads reading + tokenizing ahead (0: in the consumer; 2-core best)
  c.prefetch_buffer_size = 64  # records those threads read ahead
  # --- MLM (BERT) ---
  c.mlm_probability = 0.15  # fraction of non-special tokens selected
  c.mlm_mask_fraction = 0.8  # of the selected: become [MASK]
  c.mlm_random_fraction = 0.1  # of the selected: become a random token (the rest stay)
  # --- span corruption (T5) ---
  c.noise_density = 0.15  # fraction of tokens corrupted
  c.mean_noise_span_length = 3.0  # mean corrupted span length
  # --- synthetic translation task (source="synthetic") ---
  c.synthetic_task = "reverse"  # reverse | copy: target is the source reversed / copied
  c.synthetic_min_len = 3  # shortest source string
  c.synthetic_max_len = 12  # longest source string
  c.synthetic_alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"  # characters of the strings
  c.synthetic_train_size = 200_000  # examples in one synthetic training epoch
  c.synthetic_eval_size = 500  # examples in each held-out split (validation / test)
  c.synthetic_heldout_percent = 10  # % of strings (by crc32 hash) reserved for held-out splits
  c.synthetic_seed = 0  # generator seed; held-out strings never appear in train
  return c
