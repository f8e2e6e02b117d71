"""Text generation with a miniature GPT: a two-output functional model compiled with
`loss=[loss_fn, None]` (no loss on the second output) and fit on a TextLineDataset of IMDB
review files, with a callback that generates text by model.predict after each epoch, shrunk.

keras-io source: examples/generative/text_generation_with_miniature_gpt.py at commit
b8bb4c0d5068d64290003740c2ef9e703eefa751 (the tf.keras version with
`layers.MultiHeadAttention` and `causal_attention_mask`; `tensorflow.keras` imports are written
`keras`, and `tf.keras.losses.SparseCategoricalCrossentropy` `keras.losses....`, the same
thing with TensorFlow 2.21).

Shrunk: 128 synthetic reviews (`_synthetic.review`, one line each, with "<br />" tags and
punctuation for the custom standardization) written as text files into
workdir/aclImdb/{train,test}/{pos,neg} (32 files each) instead of IMDB's 50,000, read as the
example does (os.listdir of the four folders, random.shuffle, tf.data.TextLineDataset, shuffle(256),
batch, TextVectorization adapted on the batched text and mapped with prepare_lm_inputs_labels):
a dataset of unknown length (TextLineDataset's cardinality is UNKNOWN, so Keras learns the
number of steps by running out of data). vocab_size 20000 -> 256 (below the
synthetic vocabulary of about 420 words, so that, as in keras-io, the vocabulary fills
max_tokens=vocab_size - 1), maxlen 80 -> 32, embed_dim
and feed_forward_dim 256 -> 32, batch_size 128 -> 32 (4 steps an epoch), epochs 25 -> 1,
num_tokens_generated 40 -> 3 (each generated token is one model.predict call). Same layers,
compile ("adam", loss=[loss_fn, None]) and fit keywords (verbose=2, epochs, callbacks=[TextGenerator]).
The example evaluates nothing, so the history holds only training losses.

Causes exercised: a model with two outputs, one y and a `None` loss for the second output; a
text file pipeline of unknown length; a callback that calls model.predict between epochs.

Entry points: `model_fn()` (the example's create_model()) + `train(fit, workdir)`, and
`script(strategy, fit, workdir)`.
"""

import os
import random
import string

import numpy as np
import keras
from keras import layers

from ._synthetic import review

QUICK = True

vocab_size = 256  # Only consider the top 20k words (20000 in keras-io)
maxlen = 32  # Max sequence size (80 in keras-io)
embed_dim = 32  # Embedding size for each token (256 in keras-io)
num_heads = 2  # Number of attention heads
feed_forward_dim = 32  # Hidden layer size in feed forward network inside transformer (256 in keras-io)
batch_size = 32  # 128 in keras-io


def causal_attention_mask(batch_size, n_dest, n_src, dtype):
    """
    Mask the upper half of the dot product matrix in self attention.
    This prevents flow of information from future tokens to current token.
    1's in the lower triangle, counting from the lower right corner.
    """
    import tensorflow as tf

    i = tf.range(n_dest)[:, None]
    j = tf.range(n_src)
    m = i >= j - n_src + n_dest
    mask = tf.cast(m, dtype)
    mask = tf.reshape(mask, [1, n_dest, n_src])
    mult = tf.concat(
        [tf.expand_dims(batch_size, -1), tf.constant([1, 1], dtype=tf.int32)], 0
    )
    return tf.tile(mask, mult)


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super(TransformerBlock, self).__init__()
        self.att = layers.MultiHeadAttention(num_heads, embed_dim)
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
        import tensorflow as tf

        input_shape = tf.shape(inputs)
        batch_size = input_shape[0]
        seq_len = input_shape[1]
        causal_mask = causal_attention_mask(batch_size, seq_len, seq_len, tf.bool)
        attention_output = self.att(inputs, inputs, attention_mask=causal_mask)
        attention_output = self.dropout1(attention_output)
        out1 = self.layernorm1(inputs + attention_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super(TokenAndPositionEmbedding, self).__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        import tensorflow as tf

        maxlen = tf.shape(x)[-1]
        positions = tf.range(start=0, limit=maxlen, delta=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def model_fn():
    # create_model() from keras-io (sizes shrunk above).
    import tensorflow as tf

    inputs = layers.Input(shape=(maxlen,), dtype=tf.int32)
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, feed_forward_dim)
    x = transformer_block(x)
    outputs = layers.Dense(vocab_size)(x)
    model = keras.Model(inputs=inputs, outputs=[outputs, x])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # tf.keras.losses in keras-io
    model.compile(
        "adam",
        loss=[loss_fn, None],
    )  # No loss and optimization based on word embeddings from transformer block
    return model


def _write_imdb(root, n_per_folder=32, seed=0):
    """IMDB's layout: one review a file, one line a review (50,000 files in keras-io's download)."""
    rng = np.random.default_rng(seed)
    for split in ("train", "test"):
        for sub, positive in (("pos", True), ("neg", False)):
            folder = os.path.join(root, split, sub)
            os.makedirs(folder, exist_ok=True)
            for i in range(n_per_folder):
                with open(os.path.join(folder, f"{i}_{7 if positive else 2}.txt"), "w") as f:
                    f.write(review(rng, positive))


def custom_standardization(input_string):
    """Remove html line-break tags and handle punctuation"""
    import tensorflow as tf

    lowercased = tf.strings.lower(input_string)
    stripped_html = tf.strings.regex_replace(lowercased, "<br />", " ")
    return tf.strings.regex_replace(stripped_html, f"([{string.punctuation}])", r" \1")


class TextGenerator(keras.callbacks.Callback):
    """A callback to generate text from a trained model.
    1. Feed some starting prompt to the model
    2. Predict probabilities for the next token
    3. Sample the next token and add it to the next input

    Arguments:
        max_tokens: Integer, the number of tokens to be generated after prompt.
        start_tokens: List of integers, the token indices for the starting prompt.
        index_to_word: List of strings, obtained from the TextVectorization layer.
        top_k: Integer, sample from the `top_k` token predictions.
        print_every: Integer, print after this many epochs.
    """

    def __init__(
        self, max_tokens, start_tokens, index_to_word, top_k=10, print_every=1
    ):
        self.max_tokens = max_tokens
        self.start_tokens = start_tokens
        self.index_to_word = index_to_word
        self.print_every = print_every
        self.k = top_k

    def sample_from(self, logits):
        import tensorflow as tf

        logits, indices = tf.math.top_k(logits, k=self.k, sorted=True)
        indices = np.asarray(indices).astype("int32")
        preds = keras.activations.softmax(tf.expand_dims(logits, 0))[0]
        preds = np.asarray(preds).astype("float32")
        return np.random.choice(indices, p=preds)

    def detokenize(self, number):
        return self.index_to_word[number]

    def on_epoch_end(self, epoch, logs=None):
        start_tokens = [_ for _ in self.start_tokens]
        if (epoch + 1) % self.print_every != 0:
            return
        num_tokens_generated = 0
        tokens_generated = []
        while num_tokens_generated <= self.max_tokens:
            pad_len = maxlen - len(start_tokens)
            sample_index = len(start_tokens) - 1
            if pad_len < 0:
                x = start_tokens[:maxlen]
                sample_index = maxlen - 1
            elif pad_len > 0:
                x = start_tokens + [0] * pad_len
            else:
                x = start_tokens
            x = np.array([x])
            y, _ = self.model.predict(x)
            sample_token = self.sample_from(y[0][sample_index])
            tokens_generated.append(sample_token)
            start_tokens.append(sample_token)
            num_tokens_generated = len(tokens_generated)
        txt = " ".join(
            [self.detokenize(_) for _ in self.start_tokens + tokens_generated]
        )
        print(f"generated text:\n{txt}\n")


def _prepare(workdir):
    """The example's data preparation and callback: (text_ds, text_gen_callback)."""
    import tensorflow as tf

    dataset_dir = os.path.join(workdir, "aclImdb")  # "aclImdb" in the current directory in keras-io
    _write_imdb(dataset_dir)

    # The dataset contains each review in a separate text file
    # The text files are present in four different folders
    # Create a list all files
    filenames = []
    directories = [
        os.path.join(dataset_dir, "train/pos"),
        os.path.join(dataset_dir, "train/neg"),
        os.path.join(dataset_dir, "test/pos"),
        os.path.join(dataset_dir, "test/neg"),
    ]
    for dir in directories:
        for f in os.listdir(dir):
            filenames.append(os.path.join(dir, f))

    print(f"{len(filenames)} files")

    # Create a dataset from text files
    random.shuffle(filenames)
    text_ds = tf.data.TextLineDataset(filenames)
    text_ds = text_ds.shuffle(buffer_size=256)
    text_ds = text_ds.batch(batch_size)

    # Create a vectorization layer and adapt it to the text
    vectorize_layer = keras.layers.TextVectorization(
        standardize=custom_standardization,
        max_tokens=vocab_size - 1,
        output_mode="int",
        output_sequence_length=maxlen + 1,
    )
    vectorize_layer.adapt(text_ds)
    vocab = vectorize_layer.get_vocabulary()  # To get words back from token indices

    def prepare_lm_inputs_labels(text):
        """
        Shift word sequences by 1 position so that the target for position (i) is
        word at position (i+1). The model will use all words up till position (i)
        to predict the next word.
        """
        text = tf.expand_dims(text, -1)
        tokenized_sentences = vectorize_layer(text)
        x = tokenized_sentences[:, :-1]
        y = tokenized_sentences[:, 1:]
        return x, y

    text_ds = text_ds.map(prepare_lm_inputs_labels, num_parallel_calls=tf.data.AUTOTUNE)
    text_ds = text_ds.prefetch(tf.data.AUTOTUNE)

    # Tokenize starting prompt
    word_to_index = {}
    for index, word in enumerate(vocab):
        word_to_index[word] = index

    start_prompt = "this movie is"
    start_tokens = [word_to_index.get(_, 1) for _ in start_prompt.split()]
    num_tokens_generated = 3  # 40 in keras-io
    text_gen_callback = TextGenerator(num_tokens_generated, start_tokens, vocab)
    return text_ds, text_gen_callback


def train(fit, workdir):
    text_ds, text_gen_callback = _prepare(workdir)
    return fit(text_ds, verbose=2, epochs=1, callbacks=[text_gen_callback])  # epochs=25 in keras-io


def script(strategy, fit, workdir):
    """The example's program; the model is made in strategy.scope(), model.fit(...) is fit(model, ...)."""
    text_ds, text_gen_callback = _prepare(workdir)
    with strategy.scope():
        model = model_fn()  # model = create_model() in keras-io
    return fit(model, text_ds, verbose=2, epochs=1, callbacks=[text_gen_callback])  # epochs=25 in keras-io
