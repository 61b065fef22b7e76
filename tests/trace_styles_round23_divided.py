# Divided and grouped attention of our own: the tokens cut into groups (frames, patches, chunks, strides), moved into
# the batch axis, attended within each group (a shared token's key and value prepended to every group, the shared
# token itself attending over all), and put back. Full attention under the pattern (--mask) computes the same.
# Used by tests/test_trace_round23_divided.py. Sizes: d_model 32, 4 heads of 8.
import torch
import torch.nn.functional as F
from torch import nn


def _trained(module: nn.Module) -> nn.Module:
    """Weights moved off their initial values (no zero bias)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return module


class DividedSpaceTime(nn.Module):
    """TimeSformer-like divided attention (einops' patterns written as views and permutes: the test environment has
    no einops, and einops records as the same ops): a cls token at 0, then frames × patches (`b (f p) d`);
    `axis="time"` attends across frames for each patch, `"space"` across patches within each frame; the cls token's
    key and value are prepended to every group, its query attends over all tokens (one SDPA each)."""

    def __init__(self, dim=32, heads=4, frames=2, axis="time", bug=None):
        super().__init__()
        self.heads, self.frames, self.axis, self.bug = heads, frames, axis, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x):
        h, f = self.heads, self.frames
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.bug == "kv_swapped":
            k, v = v, k
        b, n, dim = x.shape
        p = (n - 1) // f
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2).reshape(b * h, n, -1) for t in (q, k, v))  # [(b h), n, d]
        d = q.shape[-1]
        scale = d ** -0.5
        if self.bug == "scale_twice":  # q scaled here, and again by the attention
            q = q * scale
        cls_q, q_ = q[:, :1], q[:, 1:]
        cls_k, k_ = k[:, :1], k[:, 1:]
        cls_v, v_ = v[:, :1], v[:, 1:]
        cls_out = F.scaled_dot_product_attention(cls_q, k, v, scale=scale)  # [(b h), 1, d]

        def grouped(t):  # '(b h) (f p) d -> (b h p) f d' (time) or '-> (b h f) p d' (space)
            t = t.view(b * h, f, p, d)
            return t.transpose(1, 2).reshape(b * h * p, f, d) if self.axis == "time" else t.reshape(b * h * f, p, d)

        def ungrouped(t):
            if self.axis == "time":
                return t.view(b * h, p, f, d).transpose(1, 2).reshape(b * h, f * p, d)
            return t.reshape(b * h, f * p, d)

        q_, k_, v_ = grouped(q_), grouped(k_), grouped(v_)
        r = q_.shape[0] // cls_k.shape[0]
        cls_k, cls_v = (t.repeat_interleave(r, dim=0) for t in (cls_k, cls_v))  # '(bh) () d -> (bh r) () d'
        k_, v_ = torch.cat((cls_k, k_), dim=1), torch.cat((cls_v, v_), dim=1)  # [(b h g), 1 + m, d]
        out = F.scaled_dot_product_attention(q_, k_, v_, scale=scale)  # [(b h g), m, d]
        out = torch.cat((cls_out, ungrouped(out)), dim=1)  # [(b h), n, d]
        if self.bug == "merge_dh":  # '(b h) n d -> b n (d h)'
            out = out.view(b, h, n, d).permute(0, 2, 3, 1).reshape(b, n, dim)
        else:  # '(b h) n d -> b n (h d)'
            out = out.view(b, h, n, d).transpose(1, 2).reshape(b, n, dim)
        return self.proj(out)


class ChunkGlobal(nn.Module):
    """Blocked local attention with one global token, by reshape and permute: token 0 is global (it attends over
    all and every block sees it), the other tokens cut into contiguous chunks `[b, h, n_chunk, chunk, d]` moved into
    the batch axis; the scores by matmul, the softmax by hand."""

    def __init__(self, dim=32, heads=4, chunk=3, bug=None):
        super().__init__()
        self.heads, self.chunk, self.bug = heads, chunk, bug
        self.d_head = dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        _trained(self)

    def _split(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, self.d_head).permute(0, 2, 1, 3)  # [b, h, n, d]

    def forward(self, hidden_states):
        b, n, dim = hidden_states.shape
        q = self._split(self.to_q(hidden_states))
        k = self._split(self.to_k(hidden_states))
        v = self._split(self.to_k(hidden_states) if self.bug == "v_from_k" else self.to_v(hidden_states))
        scale = self.d_head ** 0.5 if self.bug == "scale_inverted" else self.d_head ** -0.5
        g_q, g_k, g_v = q[:, :, :1], k[:, :, :1], v[:, :, :1]
        # the global token over every token
        g_w = torch.softmax(torch.matmul(g_q, k.transpose(-1, -2)) * scale, dim=-1)  # [b, h, 1, n]
        g_out = torch.matmul(g_w, v)  # [b, h, 1, d]
        c = self.chunk
        n_chunk = (n - 1) // c
        lq, lk, lv = (t[:, :, 1:].reshape(b, self.heads, n_chunk, c, self.d_head) for t in (q, k, v))
        lq, lk, lv = (t.permute(0, 2, 1, 3, 4).reshape(b * n_chunk, self.heads, c, self.d_head)
                      for t in (lq, lk, lv))  # [b·n_chunk, h, c, d]
        gk = g_k.unsqueeze(1).expand(b, n_chunk, self.heads, 1, self.d_head).reshape(b * n_chunk, self.heads, 1,
                                                                                     self.d_head)
        gv = g_v.unsqueeze(1).expand(b, n_chunk, self.heads, 1, self.d_head).reshape(b * n_chunk, self.heads, 1,
                                                                                     self.d_head)
        lk, lv = torch.cat([gk, lk], dim=2), torch.cat([gv, lv], dim=2)  # [b·n_chunk, h, 1 + c, d]
        scores = torch.matmul(lq, lk.transpose(-1, -2)) * scale  # [b·n_chunk, h, c, 1 + c]
        weights = torch.softmax(scores, dim=-2 if self.bug == "softmax_axis" else -1)
        local = torch.matmul(weights, lv)  # [b·n_chunk, h, c, d]
        local = local.reshape(b, n_chunk, self.heads, c, self.d_head).permute(0, 2, 1, 3, 4)
        local = local.reshape(b, self.heads, n_chunk * c, self.d_head)
        out = torch.cat([g_out, local], dim=2)  # [b, h, n, d]
        out = out.transpose(1, 2).reshape(b, n, dim)
        return self.to_out(out)


class StridedGroups(nn.Module):
    """Dilated (strided) groups, no shared token: token t in group t % stride, the groups moved into the batch axis
    by reshape and permute after the projection; einsum scores, a softmax, einsum back."""

    def __init__(self, dim=32, heads=4, stride=2, bug=None):
        super().__init__()
        self.heads, self.stride, self.bug = heads, stride, bug
        self.wqkv = nn.Parameter(torch.randn(dim, 3 * dim) * dim ** -0.5)
        self.wo = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x):
        b, n, dim = x.shape
        h, s = self.heads, self.stride
        qkv = (x @ self.wqkv).view(b, n // s, s, 3, h, dim // h)  # token t = i·s + g
        q, k, v = qkv.permute(3, 0, 2, 4, 1, 5).reshape(3, b * s, h, n // s, dim // h).unbind(0)  # [b·s, h, m, d]
        if self.bug == "no_scale":
            q = q
        else:
            q = q * (dim // h) ** -0.5
        w = torch.einsum('bhid,bhjd->bhij', q, k).softmax(-2 if self.bug == "softmax_axis" else -1)
        o = torch.einsum('bhij,bhjd->bhid', w, v)  # [b·s, h, m, d]
        if self.bug == "merge_dh":  # [b, m, s, d, h]: each token's features by d, then h
            o = o.reshape(b, s, h, n // s, dim // h).permute(0, 3, 1, 4, 2).reshape(b, n, dim)
        else:
            o = o.reshape(b, s, h, n // s, dim // h).permute(0, 3, 1, 2, 4).reshape(b, n, dim)
        return self.wo(o)


class TrailingGlobals(nn.Module):
    """Windows with two global tokens at the end (register tokens): the first n - 2 tokens cut into windows of 3
    `[b·windows, h, 3, d]` by reshape and transpose, the globals' keys and values appended to every window, the
    globals attending over all; `bug='local_no_scale'` leaves the scale out of the windows' scores alone."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        _trained(self)

    def forward(self, x):
        b, n, dim = x.shape
        h, d, g, w = self.heads, dim // self.heads, 2, 3
        q, k, v = self.qkv(x).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)  # [b, h, n, d] each
        s = d ** -0.5
        g_out = ((q[:, :, -g:] @ k.transpose(-1, -2)) * s).softmax(-1) @ v  # [b, h, g, d]
        nw = (n - g) // w
        lq, lk, lv = (t[:, :, :-g].reshape(b, h, nw, w, d).transpose(1, 2).reshape(b * nw, h, w, d) for t in (q, k, v))
        lk = torch.cat([lk, k[:, :, -g:].repeat_interleave(nw, dim=0)], 2)  # [b·nw, h, w + g, d]
        lv = torch.cat([lv, v[:, :, -g:].repeat_interleave(nw, dim=0)], 2)
        scores = lq @ lk.transpose(-1, -2) * (1.0 if self.bug == "local_no_scale" else s)
        local = scores.softmax(-1) @ lv  # [b·nw, h, w, d]
        local = local.reshape(b, nw, h, w, d).transpose(1, 2).reshape(b, h, nw * w, d)
        return self.out(torch.cat([local, g_out], 2).transpose(1, 2).reshape(b, n, dim))
