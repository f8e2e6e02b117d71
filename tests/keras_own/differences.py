"""Where gpupar.fit differs from Keras' model.fit on purpose: the Keras tests of keras_passes.txt it need not pass.

Each entry maps Keras' test id (as keras_passes.txt writes it) to a one-line reason; the test
runs as a strict xfail: it must fail through gpupar.fit, and a pass is reported, so the entry can
go. A plain id applies at 1 and 2 replicas; (id, replicas) at that count only. An id that is not
in keras_passes.txt is an error.
"""

_STEPS_PER_CALL = ("gpupar runs several steps per tf.function call by default (steps_per_call=auto; Keras' "
                   "steps_per_execution defaults to 1), and calls batch-level callbacks once per call, as model.fit "
                   "does with steps_per_execution > 1: this test counts one callback per batch (with "
                   "steps_per_call=1 it passes)")
_OWN_STRATEGY = ("the test makes its own tf.distribute.MirroredStrategy and builds the model in it; gpupar trains a "
                 "model under the strategy its options make (gpupar.strategy(...)), and refuses one made under "
                 "another, as README's port rule says (replace MirroredStrategy() by gpupar.strategy('mirrored'))")
_INT_OF_A_MIRRORED_VARIABLE = ("on 2 replicas the model's variables are MirroredVariables (gpupar makes them again "
                               "under the strategy, as if the model had been built in its scope), and Keras' "
                               "KerasVariable.__int__ calls int() on one, which TensorFlow does not define: the "
                               "same test fails with Keras' own fit of a model built in a MirroredStrategy's scope")
_XLA_ACROSS_REPLICAS = ("on 2 replicas the model then belongs to the MirroredStrategy, as if built in its scope, and "
                        "Keras' own evaluate of a model compiled with jit_compile=True there fails on CPUs (XLA reads "
                        "a variable on another device: tensorflow.org/xla/known_issues#tfvariable_on_a_different_"
                        "device)")
_OWN_COMPUTE_LOSS = ("a model's own compute_loss runs as Keras runs it under a strategy: the loss super().compute_loss "
                     "gives it is this replica's, divided by the replica count, so a metric of it reads 1/2 of one "
                     "device's on 2 replicas; Keras' own fit of the model built in a MirroredStrategy's scope gives "
                     "the same 2.0 where the test wants 4.0")

DIFFERENCES = {
    "backup_and_restore_test.BackupAndRestoreCallbackTest::test_best_case_step": _STEPS_PER_CALL,
    "model_checkpoint_test.ModelCheckpointTest::test_model_checkpoint_options": _STEPS_PER_CALL,
    "swap_ema_weights_test.SwapEMAWeightsTest::test_swap_ema_weights_with_tf_distribute": _OWN_STRATEGY,
    ("backup_and_restore_test.BackupAndRestoreCallbackTest::test_backup_corrupted", 2): _INT_OF_A_MIRRORED_VARIABLE,
    ("backup_and_restore_test.BackupAndRestoreCallbackTest::test_best_case_epoch", 2): _INT_OF_A_MIRRORED_VARIABLE,
    ("callback_test.CallbackTest::test_model_state_is_current_on_epoch_end", 2): _INT_OF_A_MIRRORED_VARIABLE,
    ("swap_ema_weights_test.SwapEMAWeightsTest::test_swap_ema_weights", 2): _XLA_ACROSS_REPLICAS,
    ("swap_ema_weights_test.SwapEMAWeightsTest::test_swap_ema_weights_on_epoch", 2): _XLA_ACROSS_REPLICAS,
    ("swap_ema_weights_test.SwapEMAWeightsTest::test_swap_ema_weights_with_loss_scale_optimizer", 2):
        _XLA_ACROSS_REPLICAS,
    ("trainer_test.TestTrainer::test_compute_loss_no_training_backwards_compatibility", 2): _OWN_COMPUTE_LOSS,
    ("trainer_test.TestTrainer::test_metric_update_in_compute_loss", 2): _OWN_COMPUTE_LOSS,
}
