"""Settings and inputs of model classes that their defaults and signature do not tell, declared as data.

Most classes build tiny from their own defaults scaled down (``configs``), and run on inputs probed from
``forward``'s signature and their modules (``inputs``). Some need what only reading the class tells: a setting
the scaling cannot know (a rotary split of another setting), an input whose size is a relation between settings
(audio tokens per video frame). Each such class has one entry here, keyed by its module and name, so nothing is
imported: its ``config`` is applied over the derived one and its ``inputs`` are tried before any probed ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .input_spec import BATCH, FRAMES, SEQ, SIDE, TEXT, TensorInput


@dataclass(frozen=True)
class ClassBuild:
    """What a tiny build of one class needs beyond its derived config and probed inputs.

    ``config``: constructor settings over the derived ones. ``inputs``: forward's keyword arguments (TensorInput
    or plain values) for that config, tried first. ``why``: what the derivation cannot see, shown in the sweep.
    """

    why: str
    config: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[str, Any] | None = None


def qualified_name(cls: type) -> str:
    """``module.Class``: the key of :data:`CLASS_BUILDS`."""
    return f"{cls.__module__}.{cls.__qualname__}"


def class_build(cls: type) -> ClassBuild | None:
    """The entry of ``cls`` in :data:`CLASS_BUILDS`, or None."""
    return CLASS_BUILDS.get(qualified_name(cls))


_D = "diffusers.models.transformers."
_ROW = (0,) * TEXT + (1,) * 4  # text slots, then one image's 4 tokens

CLASS_BUILDS: dict[str, ClassBuild] = {
    _D + "cogvideox_transformer_3d.CogVideoXTransformer3DModel": ClassBuild(
        why="latents are frames-first video; the text length and latent size fix its positional table",
        config={"sample_width": SIDE, "sample_height": SIDE, "max_text_seq_length": TEXT},
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, FRAMES, 16, SIDE, SIDE)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "timestep": TensorInput("tensor", values=(10, 500), dtype="long"),
            "return_dict": False,
        },
    ),
    _D + "transformer_anyflow_far.AnyFlowFARTransformer3DModel": ClassBuild(
        why="frames-first latents split into chunks, one timestep per frame",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, FRAMES, 16, SIDE, SIDE)),
            "timestep": TensorInput("full", (BATCH, FRAMES), values=(500.0,)),
            "r_timestep": TensorInput("full", (BATCH, FRAMES), values=(250.0,)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "chunk_partition": [1, 1],
            "return_dict": False,
        },
    ),
    _D + "transformer_bria_fibo.BriaFiboTransformer2DModel": ClassBuild(
        why="text_encoder_layers holds one text state per block (2 + 2), stacked on a leading dim",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 16, 64)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "text_encoder_layers": TensorInput("randn", (4, BATCH, TEXT, 16)),
            "timestep": TensorInput("tensor", values=(0.01, 0.5)),
            "img_ids": TensorInput("zeros", (16, 3)),
            "txt_ids": TensorInput("zeros", (TEXT, 3)),
            "return_dict": False,
        },
    ),
    _D + "transformer_bria_fibo2.BriaFibo2Transformer2DModel": ClassBuild(
        why="text is one bundle for the perceiver and one per text-injecting layer (here layers.1 only)",
        config={"n_refiner_layers": 1, "injection_layer_ids": (1,)},
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 32, 8, 8)),
            "timestep": TensorInput("tensor", values=(0.01, 0.5)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, 2, TEXT, 16)),
            "return_dict": False,
        },
    ),
    _D + "transformer_cosmos3.Cosmos3OmniTransformer": ClassBuild(
        why="rotary splits the head into three axes; one packed sequence of 4 text then 4 vision patch tokens",
        config={"rope_axes_dim": (4, 2, 2)},
        inputs={
            "input_ids": TensorInput("randint", (TEXT,), high=64),
            "text_indexes": TensorInput("tensor", values=(0, 1, 2, 3), dtype="long"),
            "position_ids": TensorInput("tensor", values=tuple(range(8)), dtype="long"),
            "und_len": TEXT,
            "sequence_length": 8,
            "vision_tokens": [TensorInput("randn", (48, 1, 4, 4))],
            "vision_token_shapes": [(1, 2, 2)],
            "vision_sequence_indexes": TensorInput("tensor", values=(4, 5, 6, 7), dtype="long"),
            "vision_mse_loss_indexes": TensorInput("tensor", values=(4, 5, 6, 7), dtype="long"),
            "vision_timesteps": TensorInput("full", (4,), values=(500.0,)),
            "vision_noisy_frame_indexes": [TensorInput("zeros", (1,), dtype="long")],
            "return_dict": False,
        },
    ),
    _D + "transformer_cosmos.CosmosTransformer3DModel": ClassBuild(
        why="the padding mask is resized with torchvision, which ac-core does not require",
        config={"concat_padding_mask": False},
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 16, 2, 8, 8)),
            "timestep": TensorInput("tensor", values=(10, 500), dtype="long"),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "return_dict": False,
        },
    ),
    _D + "transformer_glm_image.GlmImageTransformer2DModel": ClassBuild(
        why="one prior token id per image patch, with a boolean drop mask of the same shape",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 16, 8, 8)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "prior_token_id": TensorInput("randint", (BATCH, 16), high=16),
            "prior_token_drop": TensorInput("zeros", (BATCH, 16), dtype="bool"),
            "timestep": TensorInput("tensor", values=(10, 500), dtype="long"),
            "target_size": TensorInput("full", (BATCH, 2), values=(64.0,)),
            "crop_coords": TensorInput("zeros", (BATCH, 2)),
            "return_dict": False,
        },
    ),
    _D + "transformer_hidream_image.HiDreamImageTransformer2DModel": ClassBuild(
        why="caption channels are a (T5, Llama) pair; one Llama layer per block; rotary ids have 3 axes",
        config={"caption_channels": [16, 16], "llama_layers": [0, 1, 2, 3], "axes_dims_rope": (8, 4, 4)},
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 64, 8, 8)),
            "timesteps": TensorInput("tensor", values=(10, 500), dtype="long"),
            "encoder_hidden_states_t5": TensorInput("randn", (BATCH, TEXT, 16)),
            "encoder_hidden_states_llama3": TensorInput("randn", (4, BATCH, TEXT, 16)),
            "pooled_embeds": TensorInput("randn", (BATCH, 16)),
            "return_dict": False,
        },
    ),
    _D + "transformer_ideogram4.Ideogram4Transformer2DModel": ClassBuild(
        why="one packed sequence of text then image tokens, each input per token; indicator tags text 3, image 2",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, TEXT + 16, 16)),
            "timestep": TensorInput("tensor", values=(0.01, 0.5)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT + 16, 16)),
            "position_ids": TensorInput("zeros", (BATCH, TEXT + 16, 3), dtype="long"),
            "segment_ids": TensorInput("zeros", (BATCH, TEXT + 16), dtype="long"),
            "indicator": TensorInput(
                "tensor", (BATCH, TEXT + 16), values=((3,) * TEXT + (2,) * 16) * BATCH, dtype="long"
            ),
            "return_dict": False,
        },
    ),
    _D + "transformer_joyimage_edit_plus.JoyImageEditPlusTransformer3DModel": ClassBuild(
        why="6-D padded patch input with each sample's (t, h, w) patch grids",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 8, 16, 1, 2, 2)),
            "timestep": TensorInput("tensor", values=(10, 500), dtype="long"),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "encoder_hidden_states_mask": TensorInput("ones", (BATCH, TEXT)),
            "shape_list": [[(1, 2, 2), (1, 2, 2)]] * BATCH,
            "return_dict": False,
        },
    ),
    _D + "transformer_kandinsky.Kandinsky5Transformer3DModel": ClassBuild(
        why="latents are channels-last video; rotary positions are index lists per axis (frames, height, width)",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 2, 8, 8, 4)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "timestep": TensorInput("tensor", values=(10, 500), dtype="long"),
            "pooled_projections": TensorInput("randn", (BATCH, 16)),
            "visual_rope_pos": ([0, 1], [0, 1, 2, 3], [0, 1, 2, 3]),
            "text_rope_pos": TensorInput("tensor", values=tuple(range(TEXT)), dtype="long"),
            "return_dict": False,
        },
    ),
    _D + "transformer_krea2.Krea2Transformer2DModel": ClassBuild(
        why="text is a stack of num_text_layers (2) encoder states per token",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 16, 64)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 2, 16)),
            "timestep": TensorInput("tensor", values=(0.01, 0.5)),
            "position_ids": TensorInput("zeros", (TEXT + 16, 3), dtype="long"),
            "return_dict": False,
        },
    ),
    _D + "transformer_ltx2.LTX2VideoTransformer3DModel": ClassBuild(
        why="the audio text width is the audio heads times their dim; rotary needs the latent grid and audio frames",
        config={"audio_cross_attention_dim": 32},
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 16, 16)),
            "audio_hidden_states": TensorInput("randn", (BATCH, 8, 16)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "audio_encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "timestep": TensorInput("tensor", values=(10, 500), dtype="long"),
            "num_frames": 1,
            "height": 4,
            "width": 4,
            "audio_num_frames": 8,
            "return_dict": False,
        },
    ),
    _D + "transformer_minimax_h3.MiniMaxH3Transformer3DModel": ClassBuild(
        why="one packed sequence: per-row modality tags, timestep indices, positions and text/video/audio rows",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 8, 96)),
            "audio_hidden_states": TensorInput("randn", (BATCH, 4, 32)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "timestep": TensorInput("tensor", values=(0.5,)),
            "timestep_indices": TensorInput("zeros", (16,), dtype="long"),
            "token_tags": TensorInput("tensor", values=(1,) * 4 + (0,) * 8 + (2,) * 4, dtype="long"),
            "position_ids": TensorInput("randint", (16, 3), high=4),
            "text_indices": TensorInput("tensor", values=tuple(range(0, 4)), dtype="long"),
            "video_indices": TensorInput("tensor", values=tuple(range(4, 12)), dtype="long"),
            "audio_indices": TensorInput("tensor", values=tuple(range(12, 16)), dtype="long"),
            "return_dict": False,
        },
    ),
    _D + "transformer_minimax_music3.MiniMaxMusic3Transformer1DModel": ClassBuild(
        why="conditioning is frame-aligned to the latent length; the timestep a flow time in [0, 1]",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 16, SEQ)),
            "timestep": TensorInput("tensor", values=(0.25, 0.75)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, SEQ, 32)),
            "return_dict": False,
        },
    ),
    _D + "transformer_omnigen.OmniGenTransformer2DModel": ClassBuild(
        why="rotary needs its short and long factors; positions span the time token and the patches",
        config={"rope_scaling": {"short_factor": [1.0] * 8, "long_factor": [1.0] * 8}},
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 4, SIDE, SIDE)),
            "timestep": TensorInput("tensor", values=(10, 500), dtype="long"),
            "input_ids": None,
            "input_img_latents": None,
            "input_image_sizes": None,
            "attention_mask": None,
            "position_ids": TensorInput("randint", (BATCH, 1 + (SIDE // 2) ** 2), high=1 + (SIDE // 2) ** 2),
            "return_dict": False,
        },
    ),
    _D + "transformer_qwenimage21.QwenImage21Transformer2DModel": ClassBuild(
        why="img_mask marks which sequence slots hold image tokens (text first, then one 4-token image)",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 16, 64)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 32)),
            "timestep": TensorInput("tensor", values=(0.01, 0.5)),
            "img_shapes": [[(1, 4, 4)]] * BATCH,
            "img_mask": TensorInput("tensor", (BATCH, TEXT + 4), values=_ROW * BATCH, dtype="bool"),
            "return_dict": False,
        },
    ),
    _D + "transformer_rfd4_proteina.RFD4ProteinaTransformer": ClassBuild(
        why="protein tokens with atom37 masks; conditioning holds the topology tensors its default features read",
        inputs={
            "bb_ca": TensorInput("randn", (BATCH, SEQ, 3)),
            "local_latents": TensorInput("randn", (BATCH, SEQ, 32)),
            "bb_ca_time": TensorInput("tensor", values=(0.25, 0.75)),
            "local_latents_time": TensorInput("tensor", values=(0.5, 0.5)),
            "padding_mask": TensorInput("ones", (BATCH, SEQ), dtype="bool"),
            "token_type": TensorInput("zeros", (BATCH, SEQ), dtype="long"),
            "atom37_mask": TensorInput("ones", (BATCH, SEQ, 37), dtype="bool"),
            "conditioning": {
                "is_in_context_conditioning": TensorInput("zeros", (BATCH, SEQ), dtype="bool"),
                "supports_local_latent": TensorInput("ones", (BATCH, SEQ), dtype="bool"),
                **{
                    f"condition_{name}_1_atom": TensorInput("randint", (BATCH, SEQ, 37), high=2)
                    for name in ("hbond", "pistack", "pication", "saltbridge", "hydrophobic", "metal-coord")
                },
                "condition_index-group_1_token": TensorInput("zeros", (BATCH, SEQ), dtype="long"),
                "molecule_iid": TensorInput("zeros", (BATCH, SEQ), dtype="long"),
                "molecule_entity_id": TensorInput("zeros", (BATCH, SEQ), dtype="long"),
                "token_bond_path_length": TensorInput("randint", (BATCH, SEQ, SEQ), high=16),
            },
            "return_dict": False,
        },
    ),
    _D + "transformer_sana_wm.SanaWMTransformer3DModel": ClassBuild(
        why="per-frame timesteps (B, 1, T), text as (B, 1, L, D); a softmax block every 2 so both kinds run",
        config={"softmax_every_n": 2},
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 16, 2, 4, 4)),
            "timestep": TensorInput("randint", (BATCH, 1, 2), high=1000),
            "encoder_hidden_states": TensorInput("randn", (BATCH, 1, TEXT, 16)),
            "encoder_attention_mask": TensorInput("ones", (BATCH, TEXT)),
            "return_dict": False,
        },
    ),
    _D + "transformer_sana_wm_refiner.SanaWMLTX2RefinerTransformer3DModel": ClassBuild(
        why="the video rotary (cos, sin) is an input, stacked here on a leading axis of 2",
        inputs={
            "hidden_states": TensorInput("randn", (BATCH, 16, 16)),
            "encoder_hidden_states": TensorInput("randn", (BATCH, TEXT, 16)),
            "timestep": TensorInput("tensor", values=(10, 500), dtype="long"),
            "video_rotary_emb": TensorInput("randn", (2, BATCH, 16, 32)),
            "encoder_attention_mask": TensorInput("ones", (BATCH, TEXT)),
            "return_dict": False,
        },
    ),
    _D + "transformer_2d.Transformer2DModel": ClassBuild(
        why="patch_size None selects the continuous input path (a patch size needs another norm type)",
        config={"patch_size": None},
    ),
}
"""Per class (``module.Class``), what its tiny build needs beyond what is derived."""
