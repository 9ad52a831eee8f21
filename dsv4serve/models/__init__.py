"""Model families: one package each (`deepseek_v4/`, `glm4_moe_lite/`) exporting a `ModelSpec`
(`spec.py`), the registry of them (`registry.py`), and what every family shares: the checkpoint
loader (`loader.py`, `formats.py`), the W8A8 quantizer (`quantize.py`) and the tiny checkpoints'
helpers (`tiny.py`)."""
