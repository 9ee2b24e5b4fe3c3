"""BERT-JAM's decoder step (Eq. 10) on the static decoder step of :mod:`fairseq_ext.inference.static_step`.

A decoder layer of the paper has no separate self-attention: two joint attentions read the layer's input D^i,

    D'^i = 1/2 (Attn_joint(D^i, B^{D,i}) + Attn_joint(D^i, E^L))      (Eq. 10)

each one softmax over the keys of a memory (E^L, or the layer's BERT composite B^{D,i}, Eq. 8) followed by the keys
of the decoder's own prefix (Sec. 2.2), then the feed-forward block. On the static step each branch keeps its own
prefix cache (cache 2i: the E^L branch of layer i, 2i + 1: its BERT branch); the memories' keys and values are
projected once per search (``k_sec_proj`` / ``v_sec_proj``) and kept once per source, as for fairseq's decoder:
E^L is the search's first memory, B^{D,i} its second, with the BERT input's own length and padding. The
alignment attention is the E^L branch's weights on E^L inside the joint softmax of the last layer, averaged over
heads, as :class:`~fairseq_ext.bert_jam.model.BertJamDecoder` returns it. Eval mode only: drop-net weighs the
branches 1/2, 1/2 (Eq. 10). ``tests/bert_jam/test_static_step.py`` checks it against the decoder's full pass and
fairseq's generator.
"""

from typing import Optional

import torch
from torch import Tensor

from fairseq_ext.inference.static_step import Projections, StepGraph, decoder_refusal, linear, norm_of


class JointStepGraph(StepGraph):
    """The static step of :class:`~fairseq_ext.bert_jam.model.BertJamDecoder` (module docstring)."""

    @classmethod
    def refusal(cls, decoder) -> Optional[str]:
        for i, layer in enumerate(decoder.layers):
            # by name: the model module names this class (an import of it here would be a loop); a layer wrapped
            # by --checkpoint-activations or FSDP is another class
            if type(layer).__name__ != "BertJamDecoderLayer":
                return f"static step: decoder layer {i} is a {type(layer).__name__}, not BERT-JAM's decoder layer"
        if getattr(decoder, "adaptive_softmax", None) is not None:
            return "static step: the decoder has an adaptive softmax"
        return decoder_refusal(decoder, cls.projections(decoder))

    @classmethod
    def projections(cls, decoder) -> list:
        out = [decoder.output_projection]
        for layer in decoder.layers:
            for a in (layer.encoder_attn, layer.bert_attn):
                out += [a.q_proj, a.k_proj, a.v_proj, a.out_proj]
            out += [layer.fc1, layer.fc2]
        return out

    @classmethod
    def layer_modules(cls, layer) -> list:
        return [layer.joint_attn_layer_norm, layer.final_layer_norm]

    @classmethod
    def heads(cls, decoder) -> int:
        return decoder.layers[0].encoder_attn.num_heads

    @classmethod
    def cache_count(cls, decoder) -> int:
        return 2 * len(decoder.layers)  # each layer's two branches keep their own prefix keys / values

    @classmethod
    def memories(cls, decoder, encoder_out):
        """E^L for every layer, each layer's B^{D,i} (Eq. 8) of the rows ``bert_order`` selects, the source
        padding and the BERT input's."""
        enc = encoder_out["encoder_out"][0]
        pads = encoder_out["encoder_padding_mask"]
        bert_layers = encoder_out["bert_out"][0]
        order = encoder_out.get("bert_order") or []
        composites = []
        for layer in decoder.layers:
            b = layer.bert_composition(bert_layers)  # [S2, N, C_bert]
            composites.append(b.index_select(1, order[0]) if len(order) else b)
        return ([enc] * len(decoder.layers), composites, pads[0] if len(pads) else None,
                encoder_out["bert_padding_mask"][0])

    @classmethod
    def memory_projections(cls, decoder):
        return ([(layer.encoder_attn.k_sec_proj, layer.encoder_attn.v_sec_proj) for layer in decoder.layers],
                [(layer.bert_attn.k_sec_proj, layer.bert_attn.v_sec_proj) for layer in decoder.layers])

    def __init__(self, decoder):
        torch.nn.Module.__init__(self)
        self._embeddings(decoder)
        proj = Projections()
        self.layers = []
        for layer in decoder.layers:
            branches = [dict(qkv=proj(a.q_proj, a.k_proj, a.v_proj), o=proj(a.out_proj), scale=float(a.scaling))
                        for a in (layer.encoder_attn, layer.bert_attn)]
            self.layers.append(dict(branches=branches, nb=bool(layer.normalize_before), act=layer.activation_fn,
                                    H=layer.encoder_attn.num_heads, ln1=norm_of(layer.joint_attn_layer_norm),
                                    fc1=proj(layer.fc1), fc2=proj(layer.fc2), ln3=norm_of(layer.final_layer_norm)))
        self.int8 = proj.modules  # registered: the trace keeps their packed weights

    def forward(self, tokens: Tensor, idx: Tensor, k_cache: Tensor, v_cache: Tensor, src_k: Tensor,
                src_v: Tensor, src_bias: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_bias: Tensor):
        """:meth:`StepGraph.forward`'s inputs and outputs; the second memories are the layers' B^{D,i}."""
        N, K = tokens.shape
        B = src_k.size(1)
        P = N // B  # rows per source: row r reads source r // P
        C = self.C
        x = self._embed(tokens, idx)
        T = k_cache.size(3)
        self_bias = torch.where(torch.arange(T, device=tokens.device) > idx[-1], float("-inf"), 0.0).view(1, 1, 1, T)
        attn = x.new_zeros(0)
        last = len(self.layers) - 1
        for i, p in enumerate(self.layers):
            H = p["H"]
            d = C // H
            h = self._ln(x, p["ln1"]) if p["nb"] else x
            out = x
            memories = ((src_k[i], src_v[i], src_bias), (ctx_k[i], ctx_v[i], ctx_bias))  # E^L, B^{D,i}
            for j, (br, (mk, mv, mb)) in enumerate(zip(p["branches"], memories)):
                c = 2 * i + j
                q, k, v = linear(h, br["qkv"]).split(C, dim=1)
                k_cache[c].index_copy_(2, idx, k.reshape(N, K, H, d).transpose(1, 2))
                v_cache[c].index_copy_(2, idx, v.reshape(N, K, H, d).transpose(1, 2))
                q = q * br["scale"]
                S = mk.size(2)
                # Attn_joint: one softmax over [memory keys; prefix keys]; the memory is kept once per source, its
                # P rows query it as one block of P * K queries
                s_mem = self._scores(q.reshape(B, P * K, H, d).transpose(1, 2), mk) + mb
                s_mem = s_mem.reshape(B, H, P, K, S).transpose(1, 2).reshape(N, H, K, S)
                s_self = self._scores(q.reshape(N, K, H, d).transpose(1, 2), k_cache[c])
                w = torch.softmax(torch.cat([s_mem, s_self + self_bias], dim=-1), dim=-1)  # [N, H, K, S + T]
                w_mem = w[..., :S]
                o_mem = self._mix(w_mem.reshape(B, P, H, K, S).transpose(1, 2).reshape(B, H, P * K, S), mv)
                o = o_mem.reshape(B, H, P, K, d).transpose(1, 2).reshape(N, H, K, d) + self._mix(w[..., S:],
                                                                                                 v_cache[c])
                out = out + 0.5 * linear(o.transpose(1, 2).reshape(N * K, C), br["o"])  # Eq. 10's 1/2
                if i == last and j == 0:  # the alignment: weights on E^L of the last layer, mean of the heads
                    attn = w_mem.mean(dim=1)
            x = self._ffn(out if p["nb"] else self._ln(out, p["ln1"]), p)
        return self._final(x), attn
