"""``FeatureDictionary``: ground-truth feature directions mapping sparse feature activations to dense hidden ones.

SAELens 6.54's ``sae_lens.synthetic.feature_dictionary``, the same torch random calls in the same order, so the same
seed gives the same dictionary.

Legend: D d_model, B batch.
``num_features`` in shapes is the number of ground-truth features.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from jaxtyping import Float
from torch import Tensor, nn

from workbench.errors import InputError

FeatureDictionaryInitializer = Callable[["FeatureDictionary"], None]


def orthogonalize_embeddings(embeddings: Float[Tensor, "num_features D"], num_steps: int = 200, lr: float = 0.01,
                             show_progress: bool = False, chunk_size: int = 1024) -> Float[Tensor, "num_features D"]:
    """Unit vectors pushed towards orthogonality by Adam on the squared off-diagonal dot products (SAELens's loss:
    off-diagonal squares plus ``num_features`` times the diagonal's squared distance from 1, in chunks of
    ``chunk_size`` rows).

    Example:
        >>> vectors = orthogonalize_embeddings(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
        >>> bool((vectors @ vectors.T - torch.eye(4)).abs().max() < 0.05)
        True
    """
    del show_progress  # SAELens's progress bar; the loop is short at the sizes we run
    num_vectors = embeddings.shape[0]
    embeddings = embeddings.detach().clone()
    embeddings = embeddings / embeddings.norm(p=2, dim=1, keepdim=True).clamp(min=1e-8)
    embeddings = embeddings.requires_grad_(True)
    optimizer = torch.optim.Adam([embeddings], lr=lr)
    for _ in range(num_steps):
        optimizer.zero_grad()
        for start in range(0, num_vectors, chunk_size):
            end = min(start + chunk_size, num_vectors)
            chunk_dots = embeddings[start:end] @ embeddings.T
            rows = torch.arange(end - start, device=embeddings.device)
            off_diagonal = torch.ones_like(chunk_dots, dtype=torch.bool)
            off_diagonal[rows, start + rows] = False
            diagonal = chunk_dots[rows, start + rows]
            loss = chunk_dots[off_diagonal].pow(2).sum() + num_vectors * (diagonal - 1).pow(2).sum()
            loss.backward()
        optimizer.step()
    with torch.no_grad():
        embeddings = embeddings / embeddings.norm(p=2, dim=1, keepdim=True).clamp(min=1e-8)
    return embeddings.detach().clone()


def orthogonal_initializer(num_steps: int = 200, lr: float = 0.01, show_progress: bool = False,
                           chunk_size: int = 1024) -> FeatureDictionaryInitializer:
    """An initializer for ``FeatureDictionary`` that orthogonalizes its vectors (``orthogonalize_embeddings``).

    Example:
        >>> fd = FeatureDictionary(3, 4, initializer=orthogonal_initializer(num_steps=50), seed=0)
        >>> bool((fd.feature_vectors @ fd.feature_vectors.T - torch.eye(3)).abs().max() < 0.1)
        True
    """
    def initializer(feature_dict: "FeatureDictionary") -> None:
        feature_dict.feature_vectors.data = orthogonalize_embeddings(
            feature_dict.feature_vectors, num_steps=num_steps, lr=lr, show_progress=show_progress,
            chunk_size=chunk_size)

    return initializer


class FeatureDictionary(nn.Module):
    """``num_features`` unit feature vectors in ``D`` dimensions and a bias:
    ``hidden = feature_acts @ feature_vectors + bias``.

    ``bias``: False (zeros), True (a random vector of norm 1) or a float (that norm). ``initializer``: run after
    the random unit vectors are drawn (by default SAELens's orthogonalization); ``seed``: the draw's generator.
    More features than dimensions is superposition.

    Example:
        >>> fd = FeatureDictionary(num_features=8, hidden_dim=4, initializer=None, seed=0)
        >>> fd.feature_vectors.shape, fd(torch.eye(8)[:2]).shape
        (torch.Size([8, 4]), torch.Size([2, 4]))
    """

    feature_vectors: nn.Parameter
    bias: nn.Parameter

    def __init__(self, num_features: int, hidden_dim: int, bias: Union[bool, float] = False,
                 initializer: Optional[FeatureDictionaryInitializer] = orthogonal_initializer(),
                 device: Union[str, torch.device] = "cpu", seed: Optional[int] = None):
        super().__init__()
        if num_features < 1 or hidden_dim < 1:
            raise InputError(f"FeatureDictionary needs num_features >= 1 and hidden_dim >= 1; got {num_features} "
                             f"and {hidden_dim}")
        self.num_features = num_features
        self.hidden_dim = hidden_dim
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        embeddings = torch.randn(num_features, hidden_dim, device=device, generator=generator)
        embeddings = embeddings / embeddings.norm(p=2, dim=1, keepdim=True).clamp(min=1e-8)
        self.feature_vectors = nn.Parameter(embeddings)
        if bias:
            bias_norm = 1.0 if bias is True else float(bias)
            bias_vec = torch.randn(hidden_dim, device=device, generator=generator)
            self.bias = nn.Parameter(bias_vec / bias_vec.norm().clamp(min=1e-8) * bias_norm)
        else:
            self.bias = nn.Parameter(torch.zeros(hidden_dim, device=device), requires_grad=False)
        if initializer is not None:
            initializer(self)

    def forward(self, feature_activations: Float[Tensor, "B num_features"]) -> Float[Tensor, "B D"]:
        """Hidden activations of ``feature_activations`` (dense or sparse COO).

        Example:
            >>> fd = FeatureDictionary(2, 2, initializer=None, seed=0)
            >>> torch.allclose(fd(torch.tensor([[1.0, 0.0]])), fd.feature_vectors[:1])
            True
        """
        if feature_activations.shape[-1] != self.num_features:
            raise InputError(f"feature activations have {feature_activations.shape[-1]} features; this dictionary "
                             f"has {self.num_features}")
        if feature_activations.is_sparse:
            with torch.autocast(device_type=feature_activations.device.type, enabled=False):
                return torch.sparse.mm(feature_activations, self.feature_vectors) + self.bias
        return feature_activations @ self.feature_vectors + self.bias
