"""Small zoo configurations shared by the tests (1-channel inputs of 16-28 px, fast on CPU)."""

RESNET = "qdebug.zoo.resnet:ResNet"
# A two-stage ResNet: conftest's stage fixtures and the compare tests use it.
SMALL_RESNET = {"layers": [1, 1], "widths": [8, 16], "num_classes": 10, "in_channels": 1, "stem": "small"}
SMALL_MOBILENETV2 = {
    "num_classes": 10,
    "in_channels": 1,
    "width_mult": 0.5,
    "setting": [[1, 8, 1, 1], [6, 16, 2, 2], [6, 24, 2, 2]],
    "stem_stride": 1,
    "dropout": 0.1,
    "last_channel": 64,
}
SMALL_SHUFFLENETV2 = {
    "stages_repeats": [2, 2, 1],
    "stages_out_channels": [8, 16, 32, 64, 128],
    "num_classes": 10,
    "in_channels": 1,
    "stem_stride": 1,
}
