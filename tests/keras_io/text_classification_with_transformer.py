"""Text classification with a Transformer block, shrunk.

keras-io source: examples/nlp/text_classification_with_transformer.py at commit
1909c6710cd3f5af6401f1176dcee9e26781b4f3 (Keras 3 version, last modified 2024/01/18).

Shrunk: 256 + 64 synthetic "reviews" as lists of word indices of random length (what
keras.datasets.imdb.load_data returns; labels int64) instead of 25,000 + 25,000 IMDB reviews,
padded with keras.utils.pad_sequences as in the example; vocab_size 20000 -> 1000, maxlen 200 ->
32, embed_dim 32 -> 16, ff_dim 32 -> 16, Dense 20 -> 8. Same layers, compile arguments and fit
keywords (batch_size=32, epochs=2, validation_data).

train(fit, workdir, scale=1, epochs=2): scale multiplies the number of synthetic reviews (256 *
scale + 64 * scale; 1 is the tests' size), epochs overrides the 2 (benchmarks/keras_io.py uses both).
"""

import keras
from keras import ops
from keras import layers

from ._synthetic import imdb_sequences

QUICK = True

vocab_size = 1000  # 20000 in keras-io
maxlen = 32  # 200 in keras-io
embed_dim = 16  # 32 in keras-io
num_heads = 2
ff_dim = 16  # 32 in keras-io


class TransformerBlock(layers.Layer):
    # From keras-io @ 1909c67.
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [
                layers.Dense(ff_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    # From keras-io @ 1909c67.
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def model_fn():
    inputs = layers.Input(shape=(maxlen,))
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(8, activation="relu")(x)  # 20 in keras-io
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def train(fit, workdir, scale=1, epochs=2):
    x_train, y_train, x_val, y_val = imdb_sequences(scale, vocab_size, maxlen, max_words=60)
    return fit(x_train, y_train, batch_size=32, epochs=epochs, validation_data=(x_val, y_val))
