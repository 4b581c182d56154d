"""The target's features: one home for reading its decoder-layer outputs, online and offline, so capturing
one more layer (or another way) touches this package only. It may import `dflash_train.target`; the
target package never imports it.

    layer_ids          which target layers feed the drafter (defaults and validation)
    capture            the capture calls and the forward hooks under them
    packed_attention   which attention the target's pass over packed rows uses
    varlen             variable-length attention for packed rows, without compilation
    graphed            the packed pass replayed from CUDA graphs
    online             the features inside the training step
    store              the offline feature store (``dflash-train extract`` writes it)
    extract            prepared dataset -> feature store
    safetensors_writer safetensors files written from parts without a copy
    verify             checks of a feature store
"""
