export PYTHONPATH=$PWD CUPY_CACHE_DIR=/tmp/cc PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -n 4 tests/test_channel_stream_gpu.py tests/test_channel_gpu.py tests/test_determinism_gpu.py 2>&1 | tail -2
timeout 150 python3 -m cunorm bench --suite kernelbench --only "group_norm(8)" --no-compile --no-progress --out /tmp/kb 2>&1 | tail -1; grep "35 group" /tmp/kb/results.md
timeout 100 python3 bench/tune_channels.py --only "(8,512,128,128)" --no-launches --out $OUT 2>&1 | head -4
