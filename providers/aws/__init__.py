"""AWS EC2 provider."""
from providers.aws.client import EC2_CLIENT_CONFIG, make_ec2_client
from providers.aws.provider import AwsProvider, client_token

__all__ = ["EC2_CLIENT_CONFIG", "AwsProvider", "client_token", "make_ec2_client"]
