"""A multi-layer perceptron with configurable width, depth and activation (the search issue's space)."""

from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "elu": nn.ELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


class MLP(nn.Sequential):
    def __init__(self, in_features: int, num_classes: int = 10, width: int = 512, depth: int = 2,
                 activation: str = "relu", dropout: float = 0.0) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        for i in range(depth):
            layers += [nn.Linear(in_features if i == 0 else width, width), ACTIVATIONS[activation]()]
            if dropout:
                layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(width if depth else in_features, num_classes))
        super().__init__(*layers)
