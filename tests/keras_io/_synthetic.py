"""Seeded synthetic stand-ins for the datasets several examples download (IMDB reviews as text and as ids, MNIST digits)."""

import keras
import numpy as np

_POSITIVE = "great wonderful superb loved brilliant enjoyable moving delightful".split()
_NEGATIVE = "awful boring terrible hated dull waste poor dreadful".split()


def review(rng, positive):
    """One synthetic review: filler words from a 400-word pool plus a few sentiment words, with IMDB's <br />."""
    words = [f"w{k}" for k in rng.integers(0, 400, size=rng.integers(20, 90))]
    sentiment = _POSITIVE if positive else _NEGATIVE
    for _ in range(rng.integers(2, 6)):
        words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(sentiment)))
    text = " ".join(words)
    cut = text.rfind(" ", 0, len(text) // 2)
    return text[:cut].capitalize() + ". <br /><br />" + text[cut:].strip() + "!"


def _imdb_ids(n, rng, vocab_size, max_words):
    """Lists of word indices (1 = start, 2 = OOV, as in imdb.load_data) and int64 labels."""
    y = rng.integers(0, 2, size=n).astype("int64")
    x = []
    for label in y:
        words = rng.integers(3, vocab_size, size=rng.integers(10, max_words))
        words[rng.integers(0, len(words), size=3)] = 10 + int(label)  # class markers: the task is learnable
        x.append([1] + words.tolist())
    return x, y


def imdb_sequences(scale, vocab_size, maxlen, max_words):
    """(x_train, y_train, x_val, y_val) as keras.datasets.imdb.load_data + pad_sequences give them.

    256 * scale training and 64 * scale validation reviews of up to max_words ids below vocab_size.
    """
    rng = np.random.default_rng(0)
    x_train, y_train = _imdb_ids(256 * scale, rng, vocab_size, max_words)
    x_val, y_val = _imdb_ids(64 * scale, rng, vocab_size, max_words)
    pad = lambda x: keras.utils.pad_sequences(x, maxlen=maxlen)  # noqa: E731
    return pad(x_train), y_train, pad(x_val), y_val


def mnist_digits(n, rng):
    """uint8 (n, 28, 28) images and uint8 (n,) labels, as keras.datasets.mnist.load_data gives them.

    Each class is a noisy blob at a place of its own (3 rows x 4 columns of places), so that a small
    model can learn it.
    """
    y = rng.integers(0, 10, size=n).astype("uint8")
    yy, xx = np.mgrid[0:28, 0:28]
    x = rng.integers(0, 50, size=(n, 28, 28)).astype("float32")
    for i, label in enumerate(y):
        cy = 5 + 6 * (int(label) // 4) + rng.normal(0, 1)
        cx = 5 + 6 * (int(label) % 4) + rng.normal(0, 1)
        x[i] += 200 * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 8.0)
    return np.clip(x, 0, 255).astype("uint8"), y
