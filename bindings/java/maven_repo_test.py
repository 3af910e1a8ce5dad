"""The Maven repository of //bindings/java:maven_repo: its four files and their checksums, the sources and javadoc
jars' contents, the POM's coordinates against the jar's manifest, and a Maven project (maven_consumer/) that takes
org.seqgrad:seqgrad from it (or from what mvn install:install-file installed from it), offline, compiles against it
and trains a step with the jar Maven resolved.
usage: maven_repo_test.py JAVA VERSION CONSUMER_POM REPO_FILE..."""
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET
import zipfile

JAVA, VERSION, CONSUMER_POM = os.path.realpath(sys.argv[1]), sys.argv[2], sys.argv[3]
ARTIFACT_DIR = "org/seqgrad/seqgrad/" + VERSION
REPO_FILES = [os.path.abspath(f) for f in sys.argv[4:]]
REPO = REPO_FILES[0][:REPO_FILES[0].rindex("/" + ARTIFACT_DIR + "/")]
ARTIFACTS = [".jar", ".pom", "-sources.jar", "-javadoc.jar"]
POM_NS = {"m": "http://maven.apache.org/POM/4.0.0"}

# Maven's plugins (resources, compiler, install) come from Debian's packages in /usr/share/maven-repo (no checksums
# there): offline, a file:// repository is reachable only with aether.offline.protocols=file.
DEBIAN_SETTINGS = """<settings>
  <profiles><profile><id>debian</id>
    <pluginRepositories><pluginRepository>
      <id>debian</id><url>file:///usr/share/maven-repo</url>
      <releases><checksumPolicy>ignore</checksumPolicy></releases>
    </pluginRepository></pluginRepositories>
  </profile></profiles>
  <activeProfiles><activeProfile>debian</activeProfile></activeProfiles>
</settings>
"""


def artifact(suffix):
    return os.path.join(REPO, ARTIFACT_DIR, "seqgrad-%s%s" % (VERSION, suffix))


class MavenRepoTest(unittest.TestCase):
    def test_layout_and_checksums(self):
        names = sorted(os.path.relpath(f, REPO) for f in REPO_FILES)
        self.assertEqual(names, sorted("%s/seqgrad-%s%s%s" % (ARTIFACT_DIR, VERSION, a, c)
                                       for a in ARTIFACTS for c in ["", ".sha1"]))
        for a in ARTIFACTS:
            with open(artifact(a), "rb") as f, open(artifact(a + ".sha1")) as sha1:
                self.assertEqual(sha1.read().strip(), hashlib.sha1(f.read()).hexdigest(), a)

    def test_sources_jar_has_the_sources_under_their_packages(self):
        names = zipfile.ZipFile(artifact("-sources.jar")).namelist()
        self.assertIn("org/seqgrad/Trainer.java", names)
        self.assertIn("org/seqgrad/Version.java", names)  # generated
        with zipfile.ZipFile(artifact(".jar")) as jar:
            classes = {n for n in jar.namelist() if n.endswith(".class") and "$" not in n}
        sources = {n[:-len(".java")] + ".class" for n in names if n.endswith(".java")}
        self.assertFalse(classes - sources, "classes without sources")

    def test_javadoc_jar_documents_trainer(self):
        self.assertIn("org/seqgrad/Trainer.html", zipfile.ZipFile(artifact("-javadoc.jar")).namelist())

    def test_pom_coordinates_match_the_jar_manifest(self):
        pom = ET.parse(artifact(".pom")).getroot()
        coordinates = [pom.findtext("m:" + k, namespaces=POM_NS) for k in ["groupId", "artifactId", "version"]]
        self.assertEqual(coordinates, ["org.seqgrad", "seqgrad", VERSION])
        self.assertEqual(pom.findtext("m:packaging", namespaces=POM_NS), "jar")
        self.assertIsNone(pom.find("m:dependencies", POM_NS))
        manifest = zipfile.ZipFile(artifact(".jar")).read("META-INF/MANIFEST.MF").decode()
        entries = dict(line.split(": ", 1) for line in manifest.splitlines() if ": " in line)
        self.assertEqual(entries["Implementation-Version"], coordinates[2])

    def test_maven_project_takes_the_jar_from_the_repository(self):
        work, project, local_repo = self.consumer()
        self.maven(work, project, local_repo, "-Dseqgrad.repository=file://" + REPO, "compile")
        resolved = os.path.join(local_repo, ARTIFACT_DIR, "seqgrad-%s.jar" % VERSION)
        with open(resolved, "rb") as got, open(artifact(".jar"), "rb") as want:
            self.assertTrue(got.read() == want.read(), "Maven's copy differs from the repository's jar")
        self.train(work, project, resolved)

    def test_maven_project_takes_the_jar_installed_with_install_file(self):
        work, project, local_repo = self.consumer()
        files = ["-D%s=%s" % (key, artifact(suffix)) for key, suffix in
                 [("file", ".jar"), ("pomFile", ".pom"), ("sources", "-sources.jar"), ("javadoc", "-javadoc.jar")]]
        self.maven(work, work, local_repo, "install:install-file", *files)
        installed = os.path.join(local_repo, ARTIFACT_DIR, "seqgrad-%s" % VERSION)
        self.assertTrue(all(os.path.isfile(installed + a) for a in ARTIFACTS), os.listdir(os.path.dirname(installed)))
        self.maven(work, project, local_repo, "-Dseqgrad.repository=file://%s/none" % work, "compile")
        self.train(work, project, installed + ".jar")

    def consumer(self):
        """A fresh directory with a copy of maven_consumer/ and an empty Maven repository beside it."""
        work = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        project = os.path.join(work, "consumer")
        shutil.copytree(os.path.dirname(CONSUMER_POM), project)
        return work, project, os.path.join(work, "m2")

    def maven(self, work, cwd, local_repo, *args):
        mvn = shutil.which("mvn")
        self.assertIsNotNone(mvn, "mvn not found: ./bazelw installs Debian's maven and the plugins this test uses")
        settings = os.path.join(work, "settings.xml")
        with open(settings, "w") as f:
            f.write(DEBIAN_SETTINGS)
        build = subprocess.run(
            [mvn, "-o", "-B", "-s", settings, "-Dmaven.repo.local=" + local_repo, "-Daether.offline.protocols=file",
             "-Dseqgrad.version=" + VERSION] + list(args),
            cwd=cwd, env=self.env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.assertEqual(build.returncode, 0, build.stdout)
        self.assertNotRegex(build.stdout, r"\[WARNING\].*org\.seqgrad", "Maven warned about the artifact")

    def train(self, work, project, jar):
        run = subprocess.run(
            [JAVA, "-Djava.io.tmpdir=" + work, "-cp", os.path.join(project, "target/classes") + ":" + jar,
             "example.Main"], env=self.env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.assertEqual(run.returncode, 0, run.stdout)
        self.assertRegex(run.stdout, re.compile(r"^loss \d", re.M))

    @staticmethod
    def env(work):
        return dict(os.environ, JAVA_HOME=os.path.dirname(os.path.dirname(JAVA)), HOME=work)

if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
