"""The first stage's embedding parameter groups (states.model_groups adds them): the word embedding (Mllama's rows
beyond v), the embedding norm, learned position, token-type and projection tables, and the tables transformers counts
as parameters though nothing trains them (HRM's z_L_init, frozen sinusoidal / rotary position tables)."""

from __future__ import annotations

from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.memory.param_group import ParamGroup, number


def embedding_groups(model: ModelSpec) -> list[ParamGroup]:
    """The embedding's groups, in the order states.model_groups lists them."""
    groups: list[ParamGroup] = []
    e = embedding_widths(model)[0]  # h unless factorised (ELECTRA, RemBERT, RoFormer)
    rows = Poly.parse("v") + number(model.vocab_extra_rows) if model.vocab_extra_rows else Poly.parse("v")
    groups.append(ParamGroup("word embedding", rows * e, True, "first"))  # Mllama: 8 rows beyond v
    if model.embedding_norm:  # BLOOM: word_embeddings_layernorm; ELECTRA's e wide
        groups.append(ParamGroup("embedding norm", e * (1 + model.has_norm_bias), False, "first"))
    if model.position_embedding == "learned":
        groups.append(ParamGroup("position embedding", position_rows(model) * e, False, "first"))
    if model.token_type_rows:  # BERT: token_type_embeddings, type_vocab_size x e
        groups.append(ParamGroup("token-type embedding", number(model.token_type_rows) * e, False, "first"))
    if model.embedding_widths:  # ELECTRA embeddings_project, RemBERT embedding_hidden_mapping_in: e -> h, with bias
        groups.append(ParamGroup("embedding projection", e * Poly.parse("h") + Poly.parse("h"), False, "first"))
    if model.looped_stacks:  # HRM: z_L_init (requires_grad false; transformers counts it)
        groups.append(ParamGroup("initial state (z_L_init)", Poly.parse("h"), False, "first", trained=False,
                                 requires_grad=False))  # nn.Parameter(requires_grad=False): weights only
    if model.frozen_position_rows:  # RoFormer: encoder.embed_positions, rows x head_dim; Pegasus / Marian: rows x h
        groups.append(ParamGroup("frozen position table", number(model.frozen_position_rows) * frozen_position_width(
            model), False, "first", trained=False, requires_grad=False))  # nn.Embedding(_freeze=True): weights only
    return groups


def embedding_widths(model: ModelSpec) -> tuple[Poly, Poly]:
    """The embeddings' width e and the head's e_out (ModelSpec.embedding_widths), each h unless factorised."""
    e, e_out = model.embedding_widths or (0, 0)
    return (number(e), number(e_out)) if e else (Poly.parse("h"), Poly.parse("h"))


def position_rows(model: ModelSpec) -> Poly:
    """Rows of a learned position table: the model's own count (transformers' max_position_embeddings), else s (K22,
    Megatron-LM), and OPT's / BioGPT's 2 rows beyond (their position ids start at 2)."""
    rows = Poly.parse("s") if model.position_rows is None else Poly.parse(str(model.position_rows))
    return rows + Poly.parse(str(model.position_offset)) if model.position_offset else rows


def frozen_position_width(model: ModelSpec) -> Poly:
    """The width of a frozen position table (requires_grad false): head_dim (RoFormer's rotary table) or h (Pegasus's
    and Marian's sinusoidal embeddings)."""
    return Poly.parse("q /a" if model.frozen_position_width == "head" else "h")
