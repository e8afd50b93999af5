"""Models shared by the examples (no flags here: importing this module defines none)."""

import keras


def tutorial_cnn(activation: str = "tanh") -> keras.Model:
    """The TF Privacy tutorial CNN: 26,010 parameters on 28x28x1 inputs (tanh, as in
    Papernot et al. 2020). Layers conv1, conv2, dense, logits."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 8, strides=2, padding="same", activation=activation,
                            name="conv1"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation=activation,
                            name="conv2"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation=activation, name="dense"),
        keras.layers.Dense(10, name="logits"),
    ])
