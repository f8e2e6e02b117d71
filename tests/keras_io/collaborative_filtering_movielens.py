"""Collaborative filtering for movie recommendations (subclassed model), shrunk.

keras-io source: examples/structured_data/collaborative_filtering_movielens.py at commit
ff6a507b2737777a8845ff9a2f1caf7f53ce3e78.

Shrunk: 640 synthetic ratings (0.5 to 5.0 in steps of 0.5) by 40 users of 60 movies instead of
MovieLens' 100,836 ratings by 610 users of 9,724 movies; a dict of NumPy arrays instead of the
pandas DataFrame; user/movie ids encoded, shuffled, normalised to [0, 1] and split 90/10 as in
the example (x int64 of shape (N, 2), y float64 as pandas' Series.apply gives);
EMBEDDING_SIZE 50 -> 8; epochs 5 -> 2. The RecommenderNet subclass, compile (loss object
BinaryCrossentropy(), optimizer object Adam(learning_rate=0.001) made in the script) and fit
keywords (x=, y=, batch_size=64, epochs, verbose=1, validation_data) are the example's.

Note: the example's `tf.tensordot(user_vector, movie_vector, 2)` contracts both axes, so it adds
ONE scalar (summed over the whole batch) to every example's score: each prediction depends on the
other examples in its batch, and a fit that splits the batch (e.g. across replicas) computes a
different function. Kept as in the example.
"""

import numpy as np
import keras
import tensorflow as tf
from keras import layers

QUICK = True

EMBEDDING_SIZE = 8  # 50 in keras-io
num_users = 40
num_movies = 60


class RecommenderNet(keras.Model):
    # From keras-io @ ff6a507.
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super(RecommenderNet, self).__init__(**kwargs)
        self.num_users = num_users
        self.num_movies = num_movies
        self.embedding_size = embedding_size
        self.user_embedding = layers.Embedding(
            num_users,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = tf.tensordot(user_vector, movie_vector, 2)
        # Add all the components (including bias)
        x = dot_user_movie + user_bias + movie_bias
        # The sigmoid activation forces the rating to between 0 and 1
        return tf.nn.sigmoid(x)


def model_fn():
    model = RecommenderNet(num_users, num_movies, EMBEDDING_SIZE)
    model.compile(
        loss=tf.keras.losses.BinaryCrossentropy(),
        optimizer=keras.optimizers.Adam(learning_rate=0.001),
    )
    return model


def train(fit, workdir):
    rng = np.random.default_rng(0)
    n = 640
    # ratings.csv columns: userId, movieId (sparse ids), rating (float).
    user_pool = np.sort(rng.choice(1000, size=num_users, replace=False)) + 1
    movie_pool = np.sort(rng.choice(200000, size=num_movies, replace=False)) + 1
    taste = rng.normal(size=num_users)
    quality = rng.normal(size=num_movies)
    u = np.concatenate([np.arange(num_users), rng.integers(0, num_users, size=n - num_users)])
    m = np.concatenate([np.arange(num_movies), rng.integers(0, num_movies, size=n - num_movies)])[:n]
    score = 3.0 + taste[u] + quality[m] + rng.normal(0, 0.5, size=n)
    df = {
        "userId": user_pool[u].astype("int64"),
        "movieId": movie_pool[m].astype("int64"),
        "rating": np.clip(np.round(score * 2) / 2, 0.5, 5.0).astype("float64"),
    }

    # Preprocessing as in keras-io (pandas replaced by NumPy).
    user_ids = list(dict.fromkeys(df["userId"].tolist()))
    user2user_encoded = {x: i for i, x in enumerate(user_ids)}
    movie_ids = list(dict.fromkeys(df["movieId"].tolist()))
    movie2movie_encoded = {x: i for i, x in enumerate(movie_ids)}
    df["user"] = np.array([user2user_encoded[x] for x in df["userId"]], dtype="int64")
    df["movie"] = np.array([movie2movie_encoded[x] for x in df["movieId"]], dtype="int64")
    assert len(user2user_encoded) == num_users and len(movie2movie_encoded) == num_movies
    df["rating"] = df["rating"].astype(np.float32)
    min_rating = min(df["rating"])
    max_rating = max(df["rating"])

    order = np.random.default_rng(42).permutation(n)  # df.sample(frac=1, random_state=42)
    x = np.stack([df["user"], df["movie"]], axis=1)[order]
    # Normalize the targets between 0 and 1 (float64, as pandas' apply returns).
    y = ((df["rating"] - min_rating) / (max_rating - min_rating)).astype("float64")[order]
    train_indices = int(0.9 * n)
    x_train, x_val, y_train, y_val = (
        x[:train_indices],
        x[train_indices:],
        y[:train_indices],
        y[train_indices:],
    )
    return fit(
        x=x_train,
        y=y_train,
        batch_size=64,
        epochs=2,  # 5 in keras-io
        verbose=1,
        validation_data=(x_val, y_val),
    )
