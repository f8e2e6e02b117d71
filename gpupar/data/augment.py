"""Random shifts, rotations and zooms of the digits: one transformation, on the host or on the device.

Both placements draw each image's parameters from the same stateless random op and warp it by the
same bilinear projective map, so they give the same distribution of outputs. On the device the
warp is one batched TensorFlow op inside the train step. On the host it is the classic pipeline:
NumPy, one image at a time, in the tf.data map (as Keras' ImageDataGenerator or a PIL pipeline
does it): a Python call and a dozen small NumPy operations per image. Keras'
RandomRotation/RandomTranslation/RandomZoom are not used: like Keras' Dropout they read one seed state shared by every replica, so under
MirroredStrategy each replica would warp its images exactly like the others.
"""

import math

import numpy as np
import tensorflow as tf

MAX_DEGREES = 10.0  # rotation in [-10, 10] degrees
MAX_SHIFT = 0.1  # translation in [-10%, 10%] of the side, in each direction
MAX_ZOOM = 0.1  # scale in [0.9, 1.1]


def _transforms(params, height, width):
    """(B, 4) uniform [-1, 1) draws -> (B, 8) ImageProjectiveTransform rows (output -> input maps)."""
    angle = params[:, 0] * (MAX_DEGREES * math.pi / 180.0)
    scale = 1.0 + params[:, 1] * MAX_ZOOM
    shift_x, shift_y = params[:, 2] * (MAX_SHIFT * width), params[:, 3] * (MAX_SHIFT * height)
    cx, cy = (width - 1) / 2.0, (height - 1) / 2.0
    # input = R(-angle) (output - centre - shift) / scale + centre
    a0, a1 = tf.cos(angle) / scale, tf.sin(angle) / scale
    b0, b1 = -a1, a0
    a2 = cx - a0 * (cx + shift_x) - a1 * (cy + shift_y)
    b2 = cy - b0 * (cx + shift_x) - b1 * (cy + shift_y)
    zeros = tf.zeros_like(a0)
    return tf.stack([a0, a1, a2, b0, b1, b2, zeros, zeros], axis=1)


def _draws(num, seed):
    return tf.random.stateless_uniform([num, 4], seed=seed, minval=-1.0, maxval=1.0)


def random_affine(images, seed):
    """Warps each float image of a (B, H, W, C) batch by its own random rotation, shift and zoom.

    `seed` is a shape-(2,) int tensor; the same seed gives the same warps.
    """
    shape = tf.shape(images)
    return tf.raw_ops.ImageProjectiveTransformV3(
        images=images, transforms=_transforms(_draws(shape[0], seed), images.shape[1], images.shape[2]),
        output_shape=shape[1:3], fill_value=0.0, interpolation="BILINEAR", fill_mode="CONSTANT",
    )


def warp_numpy(image, transform):
    """The warp of ImageProjectiveTransformV3 (bilinear, zero fill) for one (H, W, C) image, in NumPy."""
    height, width = image.shape[:2]
    a0, a1, a2, b0, b1, b2, c0, c1 = (float(v) for v in transform)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    k = c0 * xs + c1 * ys + 1.0
    x, y = (a0 * xs + a1 * ys + a2) / k, (b0 * xs + b1 * ys + b2) / k
    x0, y0 = np.floor(x), np.floor(y)
    fx, fy = (x - x0)[..., None], (y - y0)[..., None]
    padded = np.pad(image, ((1, 1), (1, 1), (0, 0)))  # a zero border: reads outside give the fill value

    def read(row, col):
        row = np.clip(row.astype(np.int64) + 1, 0, height + 1)
        col = np.clip(col.astype(np.int64) + 1, 0, width + 1)
        return padded[row, col]

    top = (1 - fx) * read(y0, x0) + fx * read(y0, x0 + 1)
    bottom = (1 - fx) * read(y0 + 1, x0) + fx * read(y0 + 1, x0 + 1)
    return ((1 - fy) * top + fy * bottom).astype(np.float32)


def host_affine(image, seed):
    """Warps one float (H, W, C) image on the host, with the parameters random_affine would draw."""
    transform = _transforms(_draws(1, seed), image.shape[0], image.shape[1])[0]
    warped = tf.numpy_function(warp_numpy, [image, transform], tf.float32, stateful=False)
    return tf.ensure_shape(warped, image.shape)


def host_seed(seed, pass_number, position):
    """The seed of one example's warp on the host: its pass over the data and place in it."""
    return tf.stack([tf.constant(seed, tf.int64) * 1_000_003 + pass_number, position])


def device_seed(seed, step):
    """The seed of one replica's batch warps on the device: every replica and step draws its own.

    `step` is the optimizer's update counter, so a resumed run warps its batches as an
    uninterrupted run would, and no extra state needs checkpointing.
    """
    context = tf.distribute.get_replica_context()
    replica = tf.cast(context.replica_id_in_sync_group if context else 0, tf.int64)
    return tf.stack([(tf.constant(seed, tf.int64) * 1_000_003 + tf.cast(step, tf.int64)) * 2 + 1, replica])
