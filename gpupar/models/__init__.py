"""The models gpupar trains by name (the ConvNet, the stacked LSTM) and the layers it uses in place of Keras'."""
