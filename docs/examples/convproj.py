"""Each of q, k and v read through a tensor of its own the module makes from its input, as Microsoft's CvT writes its
convolutional projection (a depthwise Conv2d and a BatchNorm2d per role, the keys' and values' strided, the class
token kept aside and joined back; docs/trace.md, "CvT: a convolutional projection for each role")."""

import torch
import torch.nn.functional as F
from torch import nn


class CvtAttention(nn.Module):
    def __init__(self, dim_in=32, dim_out=32, num_heads=4, kernel_size=3, stride_kv=2, stride_q=1):
        super().__init__()
        self.num_heads = num_heads
        self.scale = dim_out ** -0.5
        self.conv_proj_q = self._build_projection(dim_in, kernel_size, stride_q)
        self.conv_proj_k = self._build_projection(dim_in, kernel_size, stride_kv)
        self.conv_proj_v = self._build_projection(dim_in, kernel_size, stride_kv)
        self.proj_q = nn.Linear(dim_in, dim_out, bias=False)
        self.proj_k = nn.Linear(dim_in, dim_out, bias=False)
        self.proj_v = nn.Linear(dim_in, dim_out, bias=False)
        self.proj = nn.Linear(dim_out, dim_out)

    @staticmethod
    def _build_projection(dim, kernel_size, stride):
        return nn.Sequential(nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, stride=stride, bias=False,
                                       groups=dim),
                             nn.BatchNorm2d(dim))

    def forward_conv(self, x, h, w):
        cls_token, x = torch.split(x, [1, h * w], 1)
        x = x.transpose(1, 2).reshape(x.shape[0], -1, h, w)
        q = self.conv_proj_q(x).flatten(2).transpose(1, 2)
        k = self.conv_proj_k(x).flatten(2).transpose(1, 2)
        v = self.conv_proj_v(x).flatten(2).transpose(1, 2)
        return torch.cat((cls_token, q), dim=1), torch.cat((cls_token, k), dim=1), torch.cat((cls_token, v), dim=1)

    def forward(self, x, h, w):
        q, k, v = self.forward_conv(x, h, w)
        b = x.shape[0]
        q = self.proj_q(q).reshape(b, q.shape[1], self.num_heads, -1).transpose(1, 2)
        k = self.proj_k(k).reshape(b, k.shape[1], self.num_heads, -1).transpose(1, 2)
        v = self.proj_v(v).reshape(b, v.shape[1], self.num_heads, -1).transpose(1, 2)
        attn = F.softmax(torch.einsum("bhlk,bhtk->bhlt", [q, k]) * self.scale, dim=-1)
        x = torch.einsum("bhlt,bhtv->bhlv", [attn, v])
        return self.proj(x.transpose(1, 2).reshape(b, x.shape[2], -1))
