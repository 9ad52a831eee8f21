"""Op families beside attention and MoE, in their reference math: the linear (with the weight
formats it reads: `linear.py`, `formats.py`) and DeepSeek-V4's manifold-constrained hyper-connections
(`mhc.py`)."""
