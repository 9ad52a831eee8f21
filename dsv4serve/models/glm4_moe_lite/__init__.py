"""GLM-4.7-Flash (`glm4_moe_lite`): the family's spec.

config.py (the config and its KV layout: one `full` pool of latent rows), schema.py (the checkpoint's
tensors), model.py (the math: MLA attention, dense / MoE MLPs), chat.py + parser.py (the checkpoint's
Jinja chat template and its output parser), tiny.py (the tiny checkpoint writer), configs/ (the
official `config.json`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4serve.models.glm4_moe_lite.config import GlmConfig
from dsv4serve.models.glm4_moe_lite.schema import is_mtp_tensor, tensors
from dsv4serve.models.spec import CheckpointNames, ModelContext, ModelSpec, Schema

if TYPE_CHECKING:
    from dsv4serve.chat import ChatTemplate
    from dsv4serve.layers.linear import Weights
    from dsv4serve.models.spec import ServedModel

EXPERTS = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class Glm4MoeLiteSpec(ModelSpec[GlmConfig]):
    model_type = "glm4_moe_lite"
    prompt_bos = False  # raw completion prompts start with nothing

    def config(self, raw: dict[str, Any]) -> GlmConfig:
        return GlmConfig.from_dict(raw)

    def schema(self, cfg: GlmConfig) -> Schema:
        return tensors(cfg)

    def names(self, cfg: GlmConfig) -> CheckpointNames:
        parts = {"gate": "w1", "down": "w2", "up": "w3"}
        return CheckpointNames(EXPERTS, parts, skip=lambda name: is_mtp_tensor(name, cfg))

    def build(self, cfg: GlmConfig, weights: Weights, ctx: ModelContext) -> ServedModel:
        from dsv4serve.models.glm4_moe_lite.model import Glm4MoeLite

        return Glm4MoeLite(cfg, weights, ctx)

    def make_tiny(self, out_dir: Path | str, seed: int = 0, **overrides: Any) -> Path:
        from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm

        return make_tiny_glm(out_dir, seed, **overrides)

    def chat_template(self, model_dir: Path) -> ChatTemplate:
        from dsv4serve.models.glm4_moe_lite.chat import GlmTemplate

        return GlmTemplate.from_dir(model_dir)


SPEC = Glm4MoeLiteSpec()
