"""The model registry of the PyTorch examples.

``build_model(name, ctx)`` returns ``(module, note)``; ``note`` says whose definition was used. The
built-in definitions need nothing but torch and follow the published architectures:

- ``resnet18/34/50/101/152``, ``resnext50_32x4d``: He et al. 2016 / Xie et al. 2017, laid out like
  torchvision's (stride on the 3x3 of a bottleneck, same parameter names and counts). On small inputs
  (MNIST, CIFAR: ``ctx.small_input``) the stem is a 3x3 stride-1 convolution without max-pooling.
- ``resnet20/32/44/56/110``: the CIFAR ResNets of He et al. 2016 sec. 4.2 (6n+2 layers, 16/32/64
  filters, identity shortcuts with zero-padded channels: "option A").
- ``vgg16``, ``vgg19``: Simonyan & Zisserman configurations D and E, no batch norm (torchvision's).
- ``alexnet``: torchvision's single-tower AlexNet.
- ``vit_b_16``, ``vit_s_16``: Vision Transformers (Dosovitskiy et al.), patch 16, pre-norm blocks.
- ``bn_inception``: the GoogLeNet / Inception-v1 topology with batch norm after every convolution
  (torchvision's ``googlenet`` without auxiliary heads): BN-Inception-*ish*, not Ioffe & Szegedy's
  exact network.
- ``transformer``: the SST-5 text classifier: token + learned position embeddings, pre-norm
  Transformer encoder (6 layers, 256 wide, 4 heads by default), mean pooling over real tokens.
- ``byte_lm``: a byte-level causal language model (GPT-style): byte + learned position embeddings,
  pre-norm Transformer blocks under a causal mask (2 layers, 128 wide, 4 heads by default), a final
  norm and a linear read-out over the 256 bytes; it returns the logits of every position as
  ``[batch * context, 256]`` so the driver's cross-entropy and accuracy count bytes.

For ImageNet-size inputs, ``source="auto"`` uses torchvision's definition when torchvision is
importable (``resnet*``, ``resnext50_32x4d``, ``vgg16/19``, ``alexnet``, ``vit_b_16``, ``vit_s_16`` via
``torchvision.models.VisionTransformer``, ``bn_inception`` via ``googlenet``) and these built-ins
otherwise. ``ctx.width_mult`` (< 1 for tests) scales channels and hidden sizes of the built-ins only.
"""
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelContext:
    num_classes: int = 1000
    in_channels: int = 3
    image_size: int = 224
    small_input: bool = False      # 3x3 stride-1 stem, no max-pool (MNIST / CIFAR sizes)
    width_mult: float = 1.0
    vocab_size: int = 20000        # text
    max_len: int = 256
    embed_dim: int = 256
    heads: int = 4
    layers: int = 6
    dropout: float = 0.1


@dataclass
class ModelSpec:
    name: str
    kind: str                      # "image" | "text" | "lm"
    build: Callable[[ModelContext], nn.Module]
    summary: str
    torchvision: Optional[Callable] = None  # (tv_models, ctx) -> nn.Module


MODELS: Dict[str, ModelSpec] = {}


def register(name, kind, summary, torchvision=None):
    def deco(fn):
        MODELS[name] = ModelSpec(name, kind, fn, summary, torchvision)
        return fn
    return deco


def _w(channels, ctx, minimum=4):
    return max(minimum, int(round(channels * ctx.width_mult)))


def torchvision_available():
    try:
        import torchvision.models  # noqa: F401
        return True
    except Exception:  # ImportError, or a torchvision built for another torch
        return False


def build_model(name: str, ctx: ModelContext, source: str = "auto"):
    """``(model, note)``. ``source``: ``auto`` | ``builtin`` | ``torchvision``."""
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    spec = MODELS[name]
    want_tv = source == "torchvision" or (
        source == "auto" and spec.torchvision is not None and not ctx.small_input
        and ctx.width_mult == 1.0 and ctx.in_channels == 3)
    if want_tv:
        if spec.torchvision is None:
            raise SystemExit(f"model {name!r} has no torchvision definition")
        if torchvision_available():
            import torchvision.models as tvm
            return spec.torchvision(tvm, ctx), f"torchvision definition of {name}"
        if source == "torchvision":
            raise SystemExit("--model-source torchvision, but torchvision is not importable")
        return spec.build(ctx), f"built-in definition of {name} (torchvision not importable)"
    why = "built-in definition"
    if spec.torchvision is not None and source == "auto":
        if ctx.small_input or ctx.in_channels != 3:
            why += " (small-input variant)"
        elif ctx.width_mult != 1.0:
            why += f" (width x{ctx.width_mult:g})"
    return spec.build(ctx), f"{why} of {name}"


def describe_registry():
    lines = []
    for name, spec in sorted(MODELS.items()):
        tv = " [torchvision when importable]" if spec.torchvision else ""
        lines.append(f"{name:18s} {spec.kind:5s} {spec.summary}{tv}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- ResNet / ResNeXt

def conv3x3(cin, cout, stride=1, groups=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, groups=groups, bias=False)


def conv1x1(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64):
        super().__init__()
        width = max(1, int(planes * (base_width / 64.0))) * groups
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride, groups)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes=1000, in_channels=3, width=64, groups=1,
                 width_per_group=64, small_input=False):
        super().__init__()
        self.groups, self.base_width = groups, width_per_group
        self.inplanes = width
        if small_input:
            self.conv1 = conv3x3(in_channels, width)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample, self.groups, self.base_width)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, groups=self.groups, base_width=self.base_width)
                   for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


_RESNETS = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]), "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]), "resnet101": (Bottleneck, [3, 4, 23, 3]),
    "resnet152": (Bottleneck, [3, 8, 36, 3]),
}


def _register_resnet(name, block, layers):
    depth = name[len("resnet"):]

    @register(name, "image", f"ResNet-{depth} (He et al. 2016)",
              torchvision=lambda tvm, ctx: getattr(tvm, name)(weights=None, num_classes=ctx.num_classes))
    def build(ctx):
        return ResNet(block, layers, ctx.num_classes, ctx.in_channels, _w(64, ctx),
                      small_input=ctx.small_input)
    return build


for _name, (_block, _layers) in _RESNETS.items():
    _register_resnet(_name, _block, _layers)


@register("resnext50_32x4d", "image", "ResNeXt-50 32x4d (Xie et al. 2017)",
          torchvision=lambda tvm, ctx: tvm.resnext50_32x4d(weights=None, num_classes=ctx.num_classes))
def _resnext50(ctx):
    groups = max(1, int(round(32 * ctx.width_mult)))
    return ResNet(Bottleneck, [3, 4, 6, 3], ctx.num_classes, ctx.in_channels, _w(64, ctx),
                  groups=groups, width_per_group=4, small_input=ctx.small_input)


# --------------------------------------------------------------------------- CIFAR ResNets (He et al.)

class _ShortcutA(nn.Module):
    """Identity shortcut: subsample by 2 and zero-pad the new channels (He et al. option A)."""

    def __init__(self, cin, cout):
        super().__init__()
        self.pad = cout - cin

    def forward(self, x):
        x = x[:, :, ::2, ::2]
        return F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))


class CifarBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = _ShortcutA(cin, cout) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, depth, num_classes=10, in_channels=3, width=16):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2, got {depth}")
        n = (depth - 2) // 6
        self.conv1 = conv3x3(in_channels, width)
        self.bn1 = nn.BatchNorm2d(width)
        blocks, cin = [], width
        for stage, cout in enumerate((width, width * 2, width * 4)):
            for i in range(n):
                blocks.append(CifarBlock(cin, cout, 2 if stage and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x):
        x = self.blocks(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


for _depth in (20, 32, 44, 56, 110):
    register(f"resnet{_depth}", "image", f"CIFAR ResNet-{_depth} (He et al. 2016, option A)")(
        lambda ctx, d=_depth: CifarResNet(d, ctx.num_classes, ctx.in_channels, _w(16, ctx, 2)))


# --------------------------------------------------------------------------- VGG, AlexNet

_VGG_CFGS = {
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(self, cfg, num_classes, in_channels, ctx):
        super().__init__()
        layers, cin = [], in_channels
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, _w(v, ctx), 3, padding=1), nn.ReLU(inplace=True)]
                cin = _w(v, ctx)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        hidden = _w(4096, ctx)
        self.classifier = nn.Sequential(
            nn.Linear(cin * 49, hidden), nn.ReLU(True), nn.Dropout(0.5),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(0.5), nn.Linear(hidden, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


for _name, _cfg in _VGG_CFGS.items():
    register(_name, "image", f"VGG-{_name[3:]} (Simonyan & Zisserman), no batch norm",
             torchvision=lambda tvm, ctx, n=_name: getattr(tvm, n)(weights=None, num_classes=ctx.num_classes))(
        lambda ctx, c=_cfg: VGG(c, ctx.num_classes, ctx.in_channels, ctx))


@register("alexnet", "image", "AlexNet (torchvision's single-tower variant)",
          torchvision=lambda tvm, ctx: tvm.alexnet(weights=None, num_classes=ctx.num_classes))
def _alexnet(ctx):
    c = [_w(v, ctx) for v in (64, 192, 384, 256, 256)]
    hidden = _w(4096, ctx)
    return nn.Sequential(
        nn.Sequential(
            nn.Conv2d(ctx.in_channels, c[0], 11, stride=4, padding=2), nn.ReLU(True), nn.MaxPool2d(3, 2),
            nn.Conv2d(c[0], c[1], 5, padding=2), nn.ReLU(True), nn.MaxPool2d(3, 2),
            nn.Conv2d(c[1], c[2], 3, padding=1), nn.ReLU(True),
            nn.Conv2d(c[2], c[3], 3, padding=1), nn.ReLU(True),
            nn.Conv2d(c[3], c[4], 3, padding=1), nn.ReLU(True), nn.MaxPool2d(3, 2)),
        nn.AdaptiveAvgPool2d(6), nn.Flatten(1),
        nn.Sequential(nn.Dropout(0.5), nn.Linear(c[4] * 36, hidden), nn.ReLU(True), nn.Dropout(0.5),
                      nn.Linear(hidden, hidden), nn.ReLU(True), nn.Linear(hidden, ctx.num_classes)))


# --------------------------------------------------------------------------- ViT

class VisionTransformer(nn.Module):
    def __init__(self, image_size, patch_size, layers, heads, hidden, mlp, num_classes, in_channels=3):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch_size}")
        self.conv_proj = nn.Conv2d(in_channels, hidden, patch_size, stride=patch_size)
        n = (image_size // patch_size) ** 2
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embedding = nn.Parameter(torch.empty(1, n + 1, hidden).normal_(std=0.02))
        layer = nn.TransformerEncoderLayer(hidden, heads, mlp, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True, layer_norm_eps=1e-6)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(hidden, eps=1e-6),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(hidden, num_classes)
        fan_in = in_channels * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        return self.head(self.encoder(x)[:, 0])


def _vit(ctx, layers, heads, head_dim):
    hd = max(2, int(round(head_dim * ctx.width_mult)))
    return VisionTransformer(ctx.image_size, 16, layers, heads, heads * hd, 4 * heads * hd,
                             ctx.num_classes, ctx.in_channels)


def _tv_vit(tvm, ctx, layers, heads, hidden):
    from torchvision.models.vision_transformer import VisionTransformer as TVViT
    return TVViT(image_size=ctx.image_size, patch_size=16, num_layers=layers, num_heads=heads,
                 hidden_dim=hidden, mlp_dim=4 * hidden, num_classes=ctx.num_classes)


register("vit_b_16", "image", "ViT-B/16 (12 layers, 768 wide, 12 heads)",
         torchvision=lambda tvm, ctx: _tv_vit(tvm, ctx, 12, 12, 768))(lambda ctx: _vit(ctx, 12, 12, 64))
register("vit_s_16", "image", "ViT-S/16 (12 layers, 384 wide, 6 heads)",
         torchvision=lambda tvm, ctx: _tv_vit(tvm, ctx, 12, 6, 384))(lambda ctx: _vit(ctx, 12, 6, 64))


# --------------------------------------------------------------------------- BN-Inception-ish

class _ConvBN(nn.Sequential):
    def __init__(self, cin, cout, kernel, **kw):
        super().__init__(nn.Conv2d(cin, cout, kernel, bias=False, **kw), nn.BatchNorm2d(cout, eps=0.001),
                         nn.ReLU(inplace=True))


class _Inception(nn.Module):
    def __init__(self, cin, c1, c3r, c3, c5r, c5, pool):
        super().__init__()
        self.branch1 = _ConvBN(cin, c1, 1)
        self.branch2 = nn.Sequential(_ConvBN(cin, c3r, 1), _ConvBN(c3r, c3, 3, padding=1))
        self.branch3 = nn.Sequential(_ConvBN(cin, c5r, 1), _ConvBN(c5r, c5, 3, padding=1))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True), _ConvBN(cin, pool, 1))
        self.out_channels = c1 + c3 + c5 + pool

    def forward(self, x):
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


_INCEPTION_CFG = [  # (c1, c3r, c3, c5r, c5, pool); "M" = max-pool 3/2
    (64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64), "M",
    (192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
    (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128), "M2",
    (256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128),
]


class BNInception(nn.Module):
    def __init__(self, num_classes, in_channels, ctx):
        super().__init__()
        w = lambda c: _w(c, ctx, 2)  # noqa: E731
        layers = [_ConvBN(in_channels, w(64), 7, stride=2, padding=3), nn.MaxPool2d(3, 2, ceil_mode=True),
                  _ConvBN(w(64), w(64), 1), _ConvBN(w(64), w(192), 3, padding=1),
                  nn.MaxPool2d(3, 2, ceil_mode=True)]
        cin = w(192)
        for item in _INCEPTION_CFG:
            if item == "M":
                layers.append(nn.MaxPool2d(3, 2, ceil_mode=True))
            elif item == "M2":
                layers.append(nn.MaxPool2d(2, 2, ceil_mode=True))
            else:
                block = _Inception(cin, *map(w, item))
                layers.append(block)
                cin = block.out_channels
        self.features = nn.Sequential(*layers)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.fc(self.dropout(torch.flatten(x, 1)))


register("bn_inception", "image",
         "BN-Inception-ish: GoogLeNet/Inception-v1 with batch norm after every conv (torchvision's googlenet)",
         torchvision=lambda tvm, ctx: tvm.googlenet(weights=None, aux_logits=False, init_weights=True,
                                                    num_classes=ctx.num_classes))(
    lambda ctx: BNInception(ctx.num_classes, ctx.in_channels, ctx))


# --------------------------------------------------------------------------- SST-5 Transformer

class TextTransformer(nn.Module):
    def __init__(self, vocab_size, num_classes=5, dim=256, heads=4, layers=6, max_len=256, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.pos = nn.Parameter(torch.empty(1, max_len, dim).normal_(std=0.02))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.fc = nn.Linear(dim, num_classes)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids):
        pad = ids == 0
        x = self.embed(ids) + self.pos[:, :ids.shape[1]]
        h = self.encoder(x, src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return self.fc(pooled)


register("transformer", "text", "SST-5 Transformer encoder classifier (6 layers, 256 wide, 4 heads)")(
    lambda ctx: TextTransformer(ctx.vocab_size, ctx.num_classes, ctx.embed_dim, ctx.heads, ctx.layers,
                                ctx.max_len, ctx.dropout))


# --------------------------------------------------------------------------- byte-level language model

class ByteLM(nn.Module):
    def __init__(self, vocab_size=256, dim=128, heads=4, layers=2, context=128, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.empty(1, context, dim).normal_(std=0.02))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab_size)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids):
        t = ids.shape[1]
        h = self.blocks(self.embed(ids) + self.pos[:, :t], mask=self.mask[:t, :t], is_causal=True)
        return self.head(h).reshape(-1, self.head.out_features)


register("byte_lm", "lm", "byte-level causal Transformer language model (2 layers, 128 wide, 4 heads)")(
    lambda ctx: ByteLM(ctx.vocab_size, ctx.embed_dim, ctx.heads, ctx.layers, ctx.max_len, ctx.dropout))
