"""Sequence to sequence learning for number addition (LSTM encoder, RepeatVector, LSTM decoder)
on one-hot bool arrays, shrunk.

keras-io source: examples/nlp/addition_rnn.py at commit 0e2325b31f291531990c55fec009feee850b6ca9.

Shrunk: TRAINING_SIZE 50000 -> 400 questions (DIGITS=3, REVERSE=True, generated and vectorised
by the example's CharacterTable into bool arrays x (N, 7, 12) and y (N, 4, 12)); LSTM units
128 -> 16. Same layers (Sequential: LSTM with input_shape, RepeatVector, LSTM
return_sequences=True, Dense softmax), compile arguments and fit keywords (batch_size=32,
epochs=1, validation_data).

Deviations: the example calls model.fit(..., epochs=1) once per iteration of a Python loop of 29
iterations, printing sample predictions between them; here fit is called once (one iteration),
since a fit that builds its model from model_fn would start from fresh weights on every call.
The data generator uses a seeded np.random.RandomState instead of the global np.random.
"""

import numpy as np
import keras
from keras import layers

QUICK = True

TRAINING_SIZE = 400  # 50000 in keras-io
DIGITS = 3
REVERSE = True
MAXLEN = DIGITS + 1 + DIGITS
chars = "0123456789+ "


class CharacterTable:
    """One-hot encodes characters (from keras-io; decode() left out)."""

    def __init__(self, chars):
        self.chars = sorted(set(chars))
        self.char_indices = dict((c, i) for i, c in enumerate(self.chars))
        self.indices_char = dict((i, c) for i, c in enumerate(self.chars))

    def encode(self, C, num_rows):
        x = np.zeros((num_rows, len(self.chars)))
        for i, c in enumerate(C):
            x[i, self.char_indices[c]] = 1
        return x


def model_fn():
    num_layers = 1
    model = keras.Sequential()
    model.add(layers.LSTM(16, input_shape=(MAXLEN, len(chars))))  # 128 in keras-io
    model.add(layers.RepeatVector(DIGITS + 1))
    for _ in range(num_layers):
        model.add(layers.LSTM(16, return_sequences=True))  # 128 in keras-io
    model.add(layers.Dense(len(chars), activation="softmax"))
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def train(fit, workdir):
    rs = np.random.RandomState(0)
    ctable = CharacterTable(chars)
    questions = []
    expected = []
    seen = set()
    while len(questions) < TRAINING_SIZE:
        f = lambda: int(
            "".join(rs.choice(list("0123456789")) for i in range(rs.randint(1, DIGITS + 1)))
        )
        a, b = f(), f()
        key = tuple(sorted((a, b)))
        if key in seen:
            continue
        seen.add(key)
        q = "{}+{}".format(a, b)
        query = q + " " * (MAXLEN - len(q))
        ans = str(a + b)
        ans += " " * (DIGITS + 1 - len(ans))
        if REVERSE:
            query = query[::-1]
        questions.append(query)
        expected.append(ans)

    x = np.zeros((len(questions), MAXLEN, len(chars)), dtype=np.bool_)
    y = np.zeros((len(questions), DIGITS + 1, len(chars)), dtype=np.bool_)
    for i, sentence in enumerate(questions):
        x[i] = ctable.encode(sentence, MAXLEN)
    for i, sentence in enumerate(expected):
        y[i] = ctable.encode(sentence, DIGITS + 1)

    indices = np.arange(len(y))
    rs.shuffle(indices)
    x = x[indices]
    y = y[indices]

    # Explicitly set apart 10% for validation data that we never train over.
    split_at = len(x) - len(x) // 10
    (x_train, x_val) = x[:split_at], x[split_at:]
    (y_train, y_val) = y[:split_at], y[split_at:]

    batch_size = 32
    return fit(x_train, y_train, batch_size=batch_size, epochs=1, validation_data=(x_val, y_val))
