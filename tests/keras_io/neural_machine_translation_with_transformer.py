"""English-to-Spanish translation with a sequence-to-sequence Transformer, shrunk: a model whose
output carries Keras' padding mask (PositionalEmbedding.compute_mask) and whose loss is
SparseCategoricalCrossentropy(ignore_class=0), so that Keras averages the loss over real tokens only.

keras-io source: examples/nlp/neural_machine_translation_with_transformer.py, the Keras 3 version
(fchollet, "Last modified: 2024/11/18", as keras.io renders it): TransformerDecoder called on
[x, encoder_outputs] with the two padding masks as query_mask/key_mask, a dict-input model and
compile("rmsprop", loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0),
metrics=["accuracy"]). No stored keras-team/keras-io snapshot holds that version (their .py, .md
and .ipynb are the tf.keras ones, e.g. .py at 035d541043bd29938cc78a20f19d998ffaa4a05a); see
tests/keras_io/README.md. The code here is written for this port after that program, not copied:
the same layers, masks, loss, optimizer, metrics, data pipeline and fit call.

Shrunk: 428 synthetic sentence pairs (a word-for-word "translation" through a 48-word
dictionary, 2 to 9 words, capitalised, with "." or "?" and Spanish's "¿") instead of Anki's
118,964, split 70/15/15 after a seeded shuffle as the example splits them (the test 15% is left
unused: decoding is left out); vocab_size 15000 -> 64, sequence_length 20 -> 12, embed_dim 256 ->
16, latent_dim 2048 -> 32, num_heads 8 -> 2; batch_size 64 and epochs=1 as in keras-io. Same
TextVectorization layers (Spanish with the example's custom standardization), format_dataset,
make_dataset (batch, map, cache, shuffle(2048), prefetch(16)) and fit keywords (epochs,
validation_data). About half the target positions are padding, so a loss averaged over all
positions differs much from Keras' average over real tokens.

Entry points: `model_fn()` + `train(fit, workdir)`, and `script(strategy, fit, workdir)`.
"""

import functools
import random
import re
import string

import keras
from keras import layers
from keras import ops

QUICK = True

vocab_size = 64  # 15000 in keras-io
sequence_length = 12  # 20 in keras-io
batch_size = 64
embed_dim = 16  # 256 in keras-io
latent_dim = 32  # 2048 in keras-io
num_heads = 2  # 8 in keras-io

strip_chars = (string.punctuation + "¿").replace("[", "").replace("]", "")

_DICTIONARY = dict(pair.split(":") for pair in """
    i:yo you:tú he:él she:ella we:nosotros they:ellos tom:tom mary:mary the:el a:un
    cat:gato dog:perro house:casa book:libro water:agua bread:pan city:ciudad friend:amigo
    teacher:maestro car:coche is:es was:era has:tiene wants:quiere sees:ve reads:lee eats:come
    drinks:bebe likes:gusta lives:vive big:grande small:pequeño red:rojo old:viejo new:nuevo
    good:bueno here:aquí there:allí today:hoy now:ahora not:no very:muy and:y in:en with:con
    of:de to:a my:mi your:tu
    """.split())


def _sentence_pairs(n, seed=0):
    """n (English, Spanish) pairs: 2 to 9 words translated word for word, a question one time in three."""
    rng = random.Random(seed)
    english = sorted(_DICTIONARY)
    pairs = []
    for _ in range(n):
        words = [rng.choice(english) for _ in range(rng.randint(2, 9))]
        spanish = " ".join(_DICTIONARY[w] for w in words)
        if rng.random() < 1 / 3:
            pairs.append((" ".join(words).capitalize() + "?", "¿" + spanish.capitalize() + "?"))
        else:
            pairs.append((" ".join(words).capitalize() + ".", spanish.capitalize() + "."))
    return pairs


def custom_standardization(input_string):
    """Lower case, and strip punctuation (with "¿", without the brackets of [start] and [end])."""
    import tensorflow as tf

    return tf.strings.regex_replace(tf.strings.lower(input_string), "[%s]" % re.escape(strip_chars), "")


@functools.lru_cache(maxsize=None)
def _prepared():
    """The example's data preparation: (train_pairs, val_pairs, eng_vectorization, spa_vectorization).

    Made once per process, outside any strategy scope (TextVectorization has no variables, and the
    datasets that map it are made by each train() call).
    """
    text_pairs = [(eng, "[start] " + spa + " [end]") for eng, spa in _sentence_pairs(428)]
    random.Random(1337).shuffle(text_pairs)  # random.shuffle(text_pairs) in keras-io
    num_val_samples = int(0.15 * len(text_pairs))
    num_train_samples = len(text_pairs) - 2 * num_val_samples
    train_pairs = text_pairs[:num_train_samples]
    val_pairs = text_pairs[num_train_samples: num_train_samples + num_val_samples]

    eng_vectorization = layers.TextVectorization(
        max_tokens=vocab_size, output_mode="int", output_sequence_length=sequence_length)
    spa_vectorization = layers.TextVectorization(
        max_tokens=vocab_size, output_mode="int", output_sequence_length=sequence_length + 1,
        standardize=custom_standardization)
    eng_vectorization.adapt([eng for eng, _ in train_pairs])
    spa_vectorization.adapt([spa for _, spa in train_pairs])
    return train_pairs, val_pairs, eng_vectorization, spa_vectorization


def _datasets():
    """(train_ds, val_ds): batches of ({"encoder_inputs", "decoder_inputs"}, targets), as make_dataset makes them."""
    import tensorflow as tf

    train_pairs, val_pairs, eng_vectorization, spa_vectorization = _prepared()

    def format_dataset(eng, spa):
        eng = eng_vectorization(eng)
        spa = spa_vectorization(spa)
        # The decoder reads words 0..N-1 of the target and predicts words 1..N.
        return {"encoder_inputs": eng, "decoder_inputs": spa[:, :-1]}, spa[:, 1:]

    def make_dataset(pairs):
        eng_texts, spa_texts = zip(*pairs)
        dataset = tf.data.Dataset.from_tensor_slices((list(eng_texts), list(spa_texts)))
        dataset = dataset.batch(batch_size).map(format_dataset)
        return dataset.cache().shuffle(2048).prefetch(16)

    return make_dataset(train_pairs), make_dataset(val_pairs)


class TransformerEncoder(layers.Layer):
    """Self-attention over the source, padding masked, then a feed-forward projection; passes the mask on."""

    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim = embed_dim
        self.dense_dim = dense_dim
        self.num_heads = num_heads
        self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding_mask = None if mask is None else ops.cast(mask[:, None, :], "int32")
        attended = self.attention(query=inputs, value=inputs, key=inputs, attention_mask=padding_mask)
        projected_input = self.layernorm_1(inputs + attended)
        return self.layernorm_2(projected_input + self.dense_proj(projected_input))

    def get_config(self):
        return {**super().get_config(), "embed_dim": self.embed_dim, "dense_dim": self.dense_dim,
                "num_heads": self.num_heads}


class PositionalEmbedding(layers.Layer):
    """Token plus position embeddings; its mask is the tokens that are not 0 (padding)."""

    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.position_embeddings = layers.Embedding(input_dim=sequence_length, output_dim=embed_dim)
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.embed_dim = embed_dim

    def call(self, inputs):
        positions = ops.arange(0, ops.shape(inputs)[-1], 1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length, "vocab_size": self.vocab_size,
                "embed_dim": self.embed_dim}


class TransformerDecoder(layers.Layer):
    """Causal self-attention over the target so far, attention to the encoded source, then a projection.

    Called on [target_embeddings, encoder_outputs]; Keras passes their two padding masks as `mask`.
    """

    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim = embed_dim
        self.latent_dim = latent_dim
        self.num_heads = num_heads
        self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([layers.Dense(latent_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        inputs, encoder_outputs = inputs
        inputs_padding_mask, encoder_outputs_padding_mask = (None, None) if mask is None else mask
        out_1 = self.layernorm_1(inputs + self.attention_1(
            query=inputs, value=inputs, key=inputs, attention_mask=self.get_causal_attention_mask(inputs),
            query_mask=inputs_padding_mask))
        out_2 = self.layernorm_2(out_1 + self.attention_2(
            query=out_1, value=encoder_outputs, key=encoder_outputs,
            query_mask=inputs_padding_mask, key_mask=encoder_outputs_padding_mask))
        return self.layernorm_3(out_2 + self.dense_proj(out_2))

    def get_causal_attention_mask(self, inputs):
        """(batch, length, length) int32: position i may attend to positions 0..i."""
        batch, length = ops.shape(inputs)[0], ops.shape(inputs)[1]
        lower = ops.cast(ops.arange(length)[:, None] >= ops.arange(length)[None, :], "int32")
        return ops.broadcast_to(lower[None, :, :], (batch, length, length))

    def get_config(self):
        return {**super().get_config(), "embed_dim": self.embed_dim, "latent_dim": self.latent_dim,
                "num_heads": self.num_heads}


def model_fn():
    """The example's transformer (sizes shrunk above), compiled as keras-io compiles it."""
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(encoder_inputs)
    encoder_outputs = TransformerEncoder(embed_dim, latent_dim, num_heads)(x)

    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(decoder_inputs)
    x = TransformerDecoder(embed_dim, latent_dim, num_heads)([x, encoder_outputs])
    x = layers.Dropout(0.5)(x)
    decoder_outputs = layers.Dense(vocab_size, activation="softmax")(x)
    # keras-io also wraps the decoder as a model of its own (for decoding) and the encoder; neither trains apart.
    transformer = keras.Model({"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs},
                              decoder_outputs, name="transformer")
    transformer.compile("rmsprop", loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0),
                        metrics=["accuracy"])
    return transformer


def train(fit, workdir):
    train_ds, val_ds = _datasets()
    return fit(train_ds, epochs=1, validation_data=val_ds)  # epochs = 1 in keras-io too


def script(strategy, fit, workdir):
    """The example's program; the model is made in strategy.scope(), transformer.fit(...) is fit(transformer, ...)."""
    train_ds, val_ds = _datasets()
    with strategy.scope():
        transformer = model_fn()
    return fit(transformer, train_ds, epochs=1, validation_data=val_ds)
