"""Every concrete piece of tokenloom, registered through the same hooks as a third party's."""
