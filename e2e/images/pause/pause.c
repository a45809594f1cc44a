/*
 * Minimal pod sandbox ("pause") process for the local e2e node, built with
 * `gcc -static` so the image needs no libraries (nothing can be pulled here,
 * so registry.k8s.io/pause is not an option). Same behaviour as Kubernetes'
 * build/pause/linux/pause.c: hold the pod's namespaces, reap zombies, exit 0
 * on SIGINT/SIGTERM.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef VERSION
#define VERSION "headroom"
#endif

static void on_term(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  struct sigaction term = {.sa_handler = on_term};
  struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};

  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    printf("pause.c %s\n", VERSION);
    return 0;
  }
  if (getpid() != 1) fprintf(stderr, "warning: pause should be the first process\n");
  if (sigaction(SIGINT, &term, NULL) < 0) return 1;
  if (sigaction(SIGTERM, &term, NULL) < 0) return 2;
  if (sigaction(SIGCHLD, &child, NULL) < 0) return 3;
  for (;;) pause();
  return 42;
}
