"""The benchmark of record's cases (bench/bench.py), run by cunorm.bench's
runners: the forward rows and strided axes, the Lp family and the channel
norms. The backward cases are the user-facing backward suite's
(cunorm/bench/_cases.py, BACKWARD_CASES)."""

# name, op, shape, dtype, axis, params ("w", "wb" or ""), residual, target floor%
CASES = [
    ("problem 36 rms axis=1 (112,64,512,512) fp32", "rms_norm", (112, 64, 512, 512), "float32", 1, "", False, 92),
    ("rms rows 32768x4096 bf16 +w", "rms_norm", (32768, 4096), "bfloat16", -1, "w", False, 90),
    ("rms rows 4096x32768 bf16 +w", "rms_norm", (4096, 32768), "bfloat16", -1, "w", False, 88),
    ("rms rows 65536x1024 fp32 +w", "rms_norm", (65536, 1024), "float32", -1, "w", False, 88),
    ("residual+rms rows 32768x4096 bf16 +w", "rms_norm", (32768, 4096), "bfloat16", -1, "w", True, 85),
    ("problem 40 ln axes 1-3 (16,64,256,256) fp32 +w+b", "layer_norm", (16, 64, 256, 256), "float32", (1, 2, 3),
     "wb", False, 70),
    ("ln rows 32768x4096 bf16 +w+b", "layer_norm", (32768, 4096), "bfloat16", -1, "wb", False, 88),
    ("ln rows 65536x1024 fp32 +w+b", "layer_norm", (65536, 1024), "float32", -1, "wb", False, 88),
    ("residual+ln rows 32768x4096 bf16 +w+b", "layer_norm", (32768, 4096), "bfloat16", -1, "wb", True, None),
    ("ln rows 4096x32768 bf16 +w+b", "layer_norm", (4096, 32768), "bfloat16", -1, "wb", False, 90),
    ("ln rows 65536x1024 bf16 +w+b (short rows)", "layer_norm", (65536, 1024), "bfloat16", -1, "wb", False, 90),
    ("ln rows 131072x256 bf16 +w+b (short rows)", "layer_norm", (131072, 256), "bfloat16", -1, "wb", False, None),
    ("rms rows 1x4096 bf16 +w (decode)", "rms_norm", (1, 4096), "bfloat16", -1, "w", False, None),
    ("rms rows 16x4194304 fp32 (few long rows)", "rms_norm", (16, 4194304), "float32", -1, "", False, None),
    ("rms rows 200000x64 fp16 +w (short rows)", "rms_norm", (200000, 64), "float16", -1, "w", False, None),
]


# The Lp family: name, op, shape, axis, target floor% (fp32, no parameters).
LP_CASES = [
    ("problem 39 l2 normalize axis=1 (32768,65535) fp32", "normalize", (32768, 65535), 1, 85),
    ("problem 38 mean-abs normalize axis=1 (32768,65535) fp32", "mean_abs_normalize", (32768, 65535), 1, 85),
    ("problem 37 frobenius (112,64,512,512) fp32", "frobenius_normalize", (112, 64, 512, 512), None, 64),
    ("l1 normalize rows 32768x4096 fp32", "normalize_l1", (32768, 4096), -1, None),
    ("linf normalize rows 32768x4096 fp32", "normalize_linf", (32768, 4096), -1, None),
    ("p=3 normalize rows 32768x4096 fp32", "normalize_p3", (32768, 4096), -1, None),
]


# The channel norms: name, op, shape, dtype, groups, channel_axis, params, target floor%.
CHANNEL_CASES = [
    ("problem 35 group_norm(8) (112,64,512,512) fp32 +w+b", "group_norm", (112, 64, 512, 512), "float32", 8, 1,
     "wb", 75),
    ("problem 34 instance_norm (112,64,512,512) fp32", "instance_norm", (112, 64, 512, 512), "float32", None, 1, "",
     85),
    ("problem 33 batch_norm train (64,64,512,512) fp32 +w+b", "batch_norm", (64, 64, 512, 512), "float32", None, 1,
     "wb", 64),
    ("group_norm(32) channels-last (8,128,128,512) bf16 +w+b", "group_norm", (8, 128, 128, 512), "bfloat16", 32, -1,
     "wb", 80),
]
