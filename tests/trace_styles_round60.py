"""Window attention on an image, as Florence-2's DaViT and timm's Swin block write it: the input `[b, h, w, c]`, cut
into windows inside the module, attended within each, and folded back into the image it returns, `[b, h, w, c]`
(no `.view(b, h * w, c)` at the end). `bug` plants one mistake."""

from torch import nn


class ImageWindows(nn.Module):
    def __init__(self, dim=32, heads=4, window=2, bug=""):
        super().__init__()
        self.heads, self.window, self.bug = heads, window, bug
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, h, w, c = x.shape
        s = self.window
        windows = x.view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)
        n = windows.shape[0]
        q, k, v = self.qkv(windows).reshape(n, s * s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scale = (c // self.heads) ** -0.5
        scale = scale * scale if self.bug == "scale_twice" else scale  # twice: 1 / d_head
        a = (q @ k.transpose(-2, -1) * scale).softmax(-1)
        out = self.proj((a @ v).transpose(1, 2).reshape(n, s * s, c))
        return out.view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
