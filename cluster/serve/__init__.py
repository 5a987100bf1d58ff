"""Tandem on Ray Serve: the application builder, the ingress, autoscaling, the local cluster.

`app` (three deployments from one config), `ingress` (the router as Serve's ingress: the gRPC
API, and HTTP through `http`, the OpenAI-compatible adapter), `autoscaling` (scaling each side
on its replicas' load), `ray_cluster` (the Ray cluster that `tandem serve` starts and stops;
`worker_node` adds a node to it on loopback).
"""
