"""Character-level text generation with an LSTM: one model fit again and again (`epochs=1` in a
loop), generating text with model.predict between the fits, shrunk.

keras-io source: examples/generative/lstm_character_level_text_generation.py at commit
61b6dba5e62808524df142b4c56d8266add5d349 (tf.keras version; `tensorflow.keras` imports are
written `keras`, the same thing with TensorFlow 2.21).

Shrunk: a 2,000-character synthetic corpus (`_corpus`: lowercase words and punctuation, seeded)
written to workdir/nietzsche.txt and read back as the example reads its download (io.open,
.lower(), newlines replaced by spaces) instead of Nietzsche's 600,000 characters; cut into
semi-redundant sequences and one-hot encoded as in the example (maxlen 40, step 3: 654
sequences of 22 characters: bool x (663, 40, 22) and y (663, 22)). LSTM(128) -> LSTM(16); the loop of 40
fits -> 3; 400 generated characters per diversity -> 2 (each is one model.predict call). Same
layers, optimizer (RMSprop(learning_rate=0.01)), compile (categorical_crossentropy, no metrics)
and fit keywords (x, y, batch_size=128, epochs=1). The example evaluates nothing, so each
history holds only `loss`.

Causes exercised: a model fit many times in a row (continued training: each `fit(..., epochs=1)`
starts from the weights and optimizer state the previous one left), with model.predict calls
between the fits; bool inputs and targets.

Keras' own fit under MirroredStrategy fails for it as written (bool data; see README.md).

Entry point: `script(strategy, fit, workdir)` only: the program is a loop of fits of one model,
which model_fn() + a single train(fit, workdir) can't express (a fit that builds its model from
model_fn would start every iteration from fresh weights; `addition_rnn` ports a similar loop as
a single fit for that reason). `script` returns the last fit's history.
"""

import io
import os
import random

import numpy as np
import keras
from keras import layers

QUICK = True


def _corpus(n_chars=2000, seed=0):
    """Seeded text with some structure to learn: words from a small pool, commas and full stops."""
    rng = np.random.default_rng(seed)
    pool = ("the will to power is a strong and free spirit of man who wants truth "
            "morality of the good and evil philosophers").split()
    words = []
    while sum(len(w) + 1 for w in words) < n_chars:
        words.append(str(rng.choice(pool)) + str(rng.choice(["", "", "", ",", "."])))
    text = " ".join(words)[:n_chars]
    return "\n".join(text[i : i + 70] for i in range(0, len(text), 70))  # lines, as in the download


def sample(preds, temperature=1.0):
    # helper function to sample an index from a probability array
    preds = np.asarray(preds).astype("float64")
    preds = np.log(preds) / temperature
    exp_preds = np.exp(preds)
    preds = exp_preds / np.sum(exp_preds)
    probas = np.random.multinomial(1, preds, 1)
    return np.argmax(probas)


def script(strategy, fit, workdir):
    """The example's program; what makes variables is in strategy.scope(), model.fit(...) is fit(model, ...)."""
    # keras.utils.get_file("nietzsche.txt", origin="https://s3.amazonaws.com/text-datasets/nietzsche.txt")
    # in keras-io.
    path = os.path.join(workdir, "nietzsche.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(_corpus())
    with io.open(path, encoding="utf-8") as f:
        text = f.read().lower()
    text = text.replace("\n", " ")  # We remove newlines chars for nicer display
    print("Corpus length:", len(text))

    chars = sorted(list(set(text)))
    print("Total chars:", len(chars))
    char_indices = dict((c, i) for i, c in enumerate(chars))
    indices_char = dict((i, c) for i, c in enumerate(chars))

    # cut the text in semi-redundant sequences of maxlen characters
    maxlen = 40
    step = 3
    sentences = []
    next_chars = []
    for i in range(0, len(text) - maxlen, step):
        sentences.append(text[i : i + maxlen])
        next_chars.append(text[i + maxlen])
    print("Number of sequences:", len(sentences))

    x = np.zeros((len(sentences), maxlen, len(chars)), dtype=np.bool)
    y = np.zeros((len(sentences), len(chars)), dtype=np.bool)
    for i, sentence in enumerate(sentences):
        for t, char in enumerate(sentence):
            x[i, t, char_indices[char]] = 1
        y[i, char_indices[next_chars[i]]] = 1

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input(shape=(maxlen, len(chars))),
                layers.LSTM(16),  # 128 in keras-io
                layers.Dense(len(chars), activation="softmax"),
            ]
        )
        optimizer = keras.optimizers.RMSprop(learning_rate=0.01)
        model.compile(loss="categorical_crossentropy", optimizer=optimizer)

    epochs = 3  # 40 in keras-io
    batch_size = 128

    for epoch in range(epochs):
        history = fit(model, x, y, batch_size=batch_size, epochs=1)
        print()
        print("Generating text after epoch: %d" % epoch)

        start_index = random.randint(0, len(text) - maxlen - 1)
        for diversity in [0.2, 0.5, 1.0, 1.2]:
            print("...Diversity:", diversity)

            generated = ""
            sentence = text[start_index : start_index + maxlen]
            print('...Generating with seed: "' + sentence + '"')

            for i in range(2):  # 400 in keras-io
                x_pred = np.zeros((1, maxlen, len(chars)))
                for t, char in enumerate(sentence):
                    x_pred[0, t, char_indices[char]] = 1.0
                preds = model.predict(x_pred, verbose=0)[0]
                next_index = sample(preds, diversity)
                next_char = indices_char[next_index]
                sentence = sentence[1:] + next_char
                generated += next_char

            print("...Generated: ", generated)
            print()
    return history  # the last fit's (keras-io keeps none)
