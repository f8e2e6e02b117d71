"""The TensorFlow runtime: devices and GPU memory, strategies, pipeline stages, clusters and their launcher.

Each decision is a pure function of device names or the environment (`plan_devices`,
`plan_strategy`, `plan_stages`, `parse_tf_config`), which the tests call with made-up values; one
builder each tells TensorFlow.
"""
