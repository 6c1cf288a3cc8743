"""What a training run is assembled from, whatever its parallelism: the network, optimizer and loss from the
configuration or the user's own (`build`, `parts`, `parts_check`, `adapt`: a network's own loss), and its data
from what the caller gave (`inputs`)."""
