"""Named Entity Recognition with a Transformer, shrunk: a token-classification model trained on
padded batches of sentences, its loss SparseCategoricalCrossentropy(ignore_class=0), so that
Keras averages the loss over the real tokens only (tag 0 is the padding).

keras-io source: examples/nlp/ner_transformers.py (Varun Singh), as
examples/nlp/md/ner_transformers.md renders it at commit cf18f77a4d4e3988232326e4c95eb4dd61b0b287
(the .py stored at 05d5b1fbe919ca788e2eb3e5e8cda14ff2c9b3cc is an older copy with the
experimental StringLookup). The code here is written for this port after that program, not
copied: its layers, model, data files, pipeline and compile, with these changes:

- **The loss.** The example masks the padding in a loss of its own, `CustomNonPaddingTokenLoss`
  (per-token sparse cross-entropy, times `y_true > 0`, summed, divided by the number of real
  tokens). Here the model is compiled with Keras' own
  `keras.losses.SparseCategoricalCrossentropy(ignore_class=0)`, which on one device computes that
  same number (`CustomNonPaddingTokenLoss` is kept below, and a test holds the two equal on the
  same weights), so that the padding goes through Keras' loss reduction. The example's
  `from_logits=True` on a softmax output (a slip fixed in later versions) is `from_logits=False`.
- **validation_data=val_dataset.** The example evaluates its model on val_dataset after the fit
  (its calculate_metrics, per-tag F1 by conlleval); here that evaluation is the fit's
  validation data, so that the history holds val_loss.
- Shrunk: 256 + 64 synthetic sentences of 3 to 14 words (CoNLL 2003's layout: tokens and
  their tags 0-8, O/B-PER/I-PER/B-ORG/I-ORG/B-LOC/I-LOC/B-MISC/I-MISC, each entity word always
  of one type) written into workdir/data/conll_{train,val}.txt by the example's export_to_file,
  instead of the 14,041 + 3,250 of Hugging Face's conll2003; vocab_size 20000 -> 64 (below the
  synthetic vocabulary of 77 words, so that the vocabulary fills as CoNLL's does), maxlen 128
  (kept), embed_dim 32 -> 16, num_heads 4 -> 2, ff_dim 64 -> 16; epochs 10 -> 2; batch_size 32
  kept. The datasets are the example's: TextLineDataset, map, StringLookup, padded_batch(32), so
  they have unknown length and each batch is padded to its own longest sentence.

Entry points: `model_fn()` + `train(fit, workdir)`.
"""

import collections
import functools
import os

import numpy as np
import keras
from keras import layers
from keras import ops

QUICK = True

vocab_size = 64  # 20000 in keras-io
batch_size = 32
embed_dim = 16  # 32 in keras-io
num_heads = 2  # 4 in keras-io
ff_dim = 16  # 64 in keras-io

# Synthetic words by CoNLL 2003 entity type (tags B-x, I-x as Hugging Face's conll2003 numbers them).
_ENTITIES = {
    "PER": (1, 2, "john mary smith garcia lee anna peter wang".split()),
    "ORG": (3, 4, "reuters nato fifa acme united bank council union".split()),
    "LOC": (5, 6, "london paris germany china texas berlin japan brazil".split()),
    "MISC": (7, 8, "german british french olympic euro english chinese dutch".split()),
}
_OTHER = ("the a of to in said on was for with by at he it from that is as his has will after "
          "year new two first last week than more about up but over market team game one its "
          "an were had government police official").split()


def _conll_records(n, rng):
    """n records as conll2003 gives them: {"tokens": [...], "ner_tags": [...]}, 3 to 14 words each."""
    records = []
    for _ in range(n):
        tokens, tags, length = [], [], int(rng.integers(3, 15))
        while len(tokens) < length:
            if rng.random() < 0.3:
                begin, inside, words = _ENTITIES[str(rng.choice(list(_ENTITIES)))]
                for k in range(int(rng.integers(1, 3))):
                    tokens.append(str(rng.choice(words)).capitalize())
                    tags.append(begin if k == 0 else inside)
            else:
                tokens.append(str(rng.choice(_OTHER)))
                tags.append(0)
        records.append({"tokens": tokens, "ner_tags": tags})
    return records


def export_to_file(export_file_path, data):
    """One record a line: the number of tokens, the tokens, the tags, tab-separated."""
    with open(export_file_path, "w") as f:
        for record in data:
            tokens, ner_tags = record["tokens"], record["ner_tags"]
            if len(tokens) > 0:
                f.write("\t".join([str(len(tokens)), *tokens, *map(str, ner_tags)]) + "\n")


def make_tag_lookup_table():
    """{0: "[PAD]", 1: "O", 2: "B-PER", ...}: the tags shifted by one, 0 kept for padding."""
    entity_labels = [f"{iob}-{ner}" for ner in ("PER", "ORG", "LOC", "MISC") for iob in ("B", "I")]
    return dict(enumerate(["[PAD]", "O"] + entity_labels))


mapping = make_tag_lookup_table()
num_tags = len(mapping)


@functools.lru_cache(maxsize=None)
def _conll_data():
    """The synthetic conll2003: {"train": records, "validation": records}."""
    rng = np.random.default_rng(0)
    return {"train": _conll_records(256, rng), "validation": _conll_records(64, rng)}


@functools.lru_cache(maxsize=None)
def _lookup_layer():
    """The StringLookup over the vocab_size - 2 commonest lower-cased training tokens (made once, outside any scope)."""
    all_tokens = sum((record["tokens"] for record in _conll_data()["train"]), [])
    counter = collections.Counter(token.lower() for token in all_tokens)
    # StringLookup adds an OOV token, so vocab_size - 2 words as in keras-io.
    vocabulary = [token for token, count in counter.most_common(vocab_size - 2)]
    return layers.StringLookup(vocabulary=vocabulary)


def _datasets(workdir):
    """(train_dataset, val_dataset) as the example makes them, from the files written into workdir/data."""
    import tensorflow as tf

    lookup_layer = _lookup_layer()
    data_dir = os.path.join(workdir, "data")  # "./data" in keras-io
    os.makedirs(data_dir, exist_ok=True)
    export_to_file(os.path.join(data_dir, "conll_train.txt"), _conll_data()["train"])
    export_to_file(os.path.join(data_dir, "conll_val.txt"), _conll_data()["validation"])
    train_data = tf.data.TextLineDataset(os.path.join(data_dir, "conll_train.txt"))
    val_data = tf.data.TextLineDataset(os.path.join(data_dir, "conll_val.txt"))

    def map_record_to_training_data(record):
        record = tf.strings.split(record, sep="\t")
        length = tf.strings.to_number(record[0], out_type=tf.int32)
        tokens = record[1: length + 1]
        tags = tf.strings.to_number(record[length + 1:], out_type=tf.int64) + 1  # 0 is the padding
        return tokens, tags

    def lowercase_and_convert_to_ids(tokens):
        return lookup_layer(tf.strings.lower(tokens))

    def make_dataset(data):
        # padded_batch: each record has a length of its own.
        return (data.map(map_record_to_training_data)
                .map(lambda x, y: (lowercase_and_convert_to_ids(x), y))
                .padded_batch(batch_size))

    return make_dataset(train_data), make_dataset(val_data)


class TransformerBlock(layers.Layer):
    """Self-attention and a feed-forward network, each with dropout, a residual and layer normalisation."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        out1 = self.layernorm1(inputs + self.dropout1(self.att(inputs, inputs), training=training))
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1), training=training))


class TokenAndPositionEmbedding(layers.Layer):
    """Token plus position embeddings (no mask: the padding is left to the loss)."""

    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, inputs):
        positions = ops.arange(0, ops.shape(inputs)[-1], 1)
        return self.token_emb(inputs) + self.pos_emb(positions)


class NERModel(keras.Model):
    """Embeddings, one Transformer block, then a tag distribution for every token."""

    def __init__(self, num_tags, vocab_size, maxlen=128, embed_dim=32, num_heads=2, ff_dim=32):
        super().__init__()
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        self.transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
        self.dropout1 = layers.Dropout(0.1)
        self.ff = layers.Dense(ff_dim, activation="relu")
        self.dropout2 = layers.Dropout(0.1)
        self.ff_final = layers.Dense(num_tags, activation="softmax")

    def call(self, inputs, training=False):
        x = self.transformer_block(self.embedding_layer(inputs))
        x = self.ff(self.dropout1(x, training=training))
        return self.ff_final(self.dropout2(x, training=training))


class CustomNonPaddingTokenLoss(keras.losses.Loss):
    """The example's loss (not compiled here; see the module docstring): the mean over tokens whose tag is not 0."""

    def __init__(self, name="custom_ner_loss"):
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False, reduction=None)
        mask = ops.cast(y_true > 0, "float32")
        return ops.sum(loss_fn(y_true, y_pred) * mask) / ops.sum(mask)


def model_fn():
    """The example's NERModel (sizes shrunk above), compiled with adam and Keras' ignore_class loss."""
    ner_model = NERModel(num_tags, vocab_size, embed_dim=embed_dim, num_heads=num_heads, ff_dim=ff_dim)
    # loss=CustomNonPaddingTokenLoss() in keras-io; the same number, through Keras' own masking.
    ner_model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0))
    return ner_model


def train(fit, workdir):
    train_dataset, val_dataset = _datasets(workdir)
    # epochs=10 and no validation_data in keras-io, which evaluates val_dataset after the fit.
    return fit(train_dataset, epochs=2, validation_data=val_dataset)
