# syntax=docker/dockerfile:1
# headroom-operator image for users with Docker (or any BuildKit builder).
# The same contents as the Docker-free build on the e2e machine:
#
#   cargo build --release -p headroom-operator --bin headroom-operator
#   e2e/images/build.sh headroom-operator target/release/headroom-operator
#
# Both run e2e/images/mkrootfs.sh (binary + the shared libraries ldd finds +
# passwd/group with nonroot 65532 + /tmp 1777 + CA bundle) on Debian 12, and
# set the same user, workdir, PATH and entrypoint. See e2e/images/README.md
# for what can still differ.
#
# Build from the repository root:
#   docker build -f e2e/images/operator.Dockerfile -t localhost/headroom-operator:dev .
# kind: kind load docker-image localhost/headroom-operator:dev

ARG RUST_VERSION=1.95
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p headroom-operator --bin headroom-operator \
 && install -m 0755 target/release/headroom-operator /headroom-operator
RUN e2e/images/mkrootfs.sh /rootfs /headroom-operator

FROM scratch
COPY --from=build /rootfs/ /
# COPY does not promise to keep the owner; the home directory is 65532's.
COPY --from=build --chown=65532:65532 /rootfs/home/nonroot /home/nonroot
USER 65532:65532
WORKDIR /home/nonroot
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin
LABEL org.opencontainers.image.title=headroom-operator
ENTRYPOINT ["/usr/local/bin/headroom-operator"]
